"""The cache layer every selector builds: a transformers ``CacheLayerMixin`` over a storage ``Store``.

It keeps what all selectors share: tokens consumed (``seen``, the absolute position of the next token),
the validity of stored tokens once padding appears, eviction counts, and the selector's own per-token
and per-row tensors (named in ``per_token`` / ``per_row``, moved with every eviction and beam reorder).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcompress.core import attention
from kvcompress.core.buffers import Slots, storage_bytes, writing
from kvcompress.core.masks import cat_valid
from kvcompress.core.plan import Dense, Plan
from kvcompress.core.profiling import TIMER
from kvcompress.core.storage import reorder_all
from kvcompress.core.torch_attention import window_scores


class PolicyLayer(CacheLayerMixin):
    """Stores every token (the ``full`` selector). Subclasses select in ``compress()`` (after the step's
    tokens are appended) or in ``observe_attention()`` (after attention, when ``wants_scores``)."""

    is_sliding = False
    is_compileable = False
    wants_scores = False
    wants_hidden = False  # the step's input hidden states (B, q, hidden) arrive as ``hidden`` (KVzap)
    hidden: torch.Tensor | None = (
        None  # this step's, taken from the forward's state (``attention.hidden_hook``)
    )
    order_free = False  # True: no decision depends on stored order, so evicting one token may reorder
    needs_positions = False  # track each stored token's absolute position (``pos``) even on full layers
    contiguous = False  # stored tokens are always the latest ones in order (positions need no tracking)
    per_token: tuple[str, ...] = ()  # (B, 1 or H_kv, T) tensors aligned with the stored tokens
    per_row: tuple[str, ...] = ()  # (B, ...) tensors
    deferred = False  # this step's attention reads the store's compact form (``plan``), not a dense copy
    open = False  # this step ends after its attention (``attended``): its selector observes, or it deferred
    # the step's attention reads every stored token as stored (no selection of reads, no eviction inside the
    # step), so the store's compact form can serve a decode step; False where ``compress``/``attend`` select
    reads_as_stored = True
    # optional hooks of a selector's layer (None: the step does not call them)
    on_append = None  # on_append(key_states (B, H_kv, q, D), new_valid (B, q) or None): before the step's
    #                   tokens are stored, grow the selector's own state
    compress = None  # compress(keys, values (B, H_kv, T, D)): select after the step's tokens were appended,
    #                  from what this step's attention reads (sliding windows, page summaries)
    probe = None  # a fidelity probe watching this layer (``watch``), or None
    read_pos: torch.Tensor | None = None  # (B, 1 or H_kv, T) positions this step's attention reads (probed)
    probe_only_pos = False  # ``pos`` is tracked only for the probe: not the policy's bytes
    grouped_decode = False  # a decode query attends in the grouped form of the eviction layers
    # what ``observe_attention`` gets back from the backend (``plan.PROBS``); "none": it ranks from keys alone
    observed_probs = "last"

    def __init__(self, policy, layer_idx: int, spec, store):
        self.is_initialized = (
            False  # CacheLayerMixin.__init__ would assign keys/values, which live in the store
        )
        self.policy, self.layer_idx, self.spec, self.store = policy, layer_idx, spec, store
        self.valid: torch.Tensor | None = None  # (B, 1 or H_kv, T) bool; None = no padding stored
        self.window, self.chunked = spec.window(layer_idx), spec.chunked(layer_idx)  # the model's own
        self.track = self.needs_positions or (self.window is not None and not self.contiguous)
        self.pos: torch.Tensor | None = None  # (B, 1 or H_kv, T) int32 absolute positions, when tracked
        self.left_pad: torch.Tensor | None = None  # (B,) leading padding of each row (chunked layers)
        # a prefill-time selector over a store that cannot evict encoded tokens exactly encodes nothing on a
        # multi-token step (``end_step``): every token is encoded once, after its last chance of eviction
        self.encodes_late = policy.evicts == "prefill" and not store.keeps_exactly
        self.step_tokens = 0  # tokens of the step being stored
        self.deferred = self.open = False  # the step's read and end (class attributes above)
        self.seen = self.evicted = 0
        # for ``core.rollback``: the newest tokens stored since the eviction count was ``tail_evicted``
        self.tail_tokens = self.tail_evicted = 0
        self.tokens_read, self.tokens_visible = 0, 0  # over steps: read by the last query / by the model's
        self.backends_ran: dict[str, int] = {}  # attention backend -> steps it ran (``executor``)
        self.reads_ran: dict[str, int] = {}  # read form (dense, kivi, latent, pages) -> steps
        self._view: tuple[int, torch.Tensor | None] | None = None
        self.slots = Slots()  # buffers of per-token state (``pos``, ``per_token``) this layer grows in place
        for name in self.per_token + self.per_row:
            setattr(self, name, None)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    # -- the transformers contract -------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' ``Cache.update`` of this layer: this step's keys/values (B, H_kv, q, D) and what the
        model's attention passed with them (``step_inputs``). Stores them (``step``) and hands this layer to
        the attention function that follows (the forward's ``pending``); returns what that attention must
        see."""
        positions, forward = step_inputs(key_states, args, kwargs)
        if forward is not None:
            forward.pending[self.layer_idx] = self
        if TIMER.enabled:  # policy time (the benchmark's), around the step only
            with TIMER.measure():
                return self.step(key_states, value_states, positions, forward)
        return self.step(key_states, value_states, positions, forward)

    def step(self, key_states, value_states, positions=None, forward=None):
        """Store this step's keys/values (B, H_kv, q, D); return what this step's attention must see.
        ``positions``: the model's ``position_ids`` (B or 1, q) or None; ``forward``: this forward's
        ``ForwardState`` (its padding), None for a layer driven by hand."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.open or self.deferred:  # the last step's attention never came: end it now
            self.end_deferred()
        if self.probe is not None:
            self.probe.stored(self, key_states, value_states)
        b, _, q, _ = key_states.shape
        device = key_states.device
        new_valid = None if forward is None else forward.new_token_validity(b, q, device)
        if self.wants_hidden:  # only a layer that asked pays the call (kvzap)
            self.take_hidden(forward)
        if self.on_append is not None:
            self.on_append(key_states, new_valid)
        if self.seen == 0 and self.chunked:
            self.left_pad = _leading_padding(new_valid, b, device)
        if new_valid is not None or self.valid is not None:
            self.valid = cat_valid(self.valid, new_valid, self.stored_length(), b, q, device)
        if self.track:
            self.pos = _cat_positions(self.slots, self.pos, self.seen, b, q, device)
        self.store.append(key_states, value_states, positions)
        self.seen, self.step_tokens = self.seen + q, q
        if self.evicted != self.tail_evicted:  # an eviction since the tail began: it starts again here
            self.tail_tokens, self.tail_evicted = 0, self.evicted
        self.tail_tokens += q
        if self.reads_as_stored and self.store.compact and q == 1 and self.valid is None and self._defers():
            total = self.stored_length()
            self.deferred = self.open = True
            self._view = (total, None, None)
            return _unread(key_states, total), _unread(value_states, total)
        keys, values = self.store.read()
        self._view = (keys.shape[-2], self.valid, None if self.probe_only_pos else self.pos)
        if self.probe is not None:  # before compress: the positions of what this step's attention reads
            self.read_pos = self.pos
        if self.compress is not None:
            self.compress(keys, values)
        self.open = self.wants_scores
        if not self.open:
            self.end_step()
        return keys, values

    def take_hidden(self, forward) -> None:
        """This step's input hidden states (B, q, hidden) from the forward's state into ``hidden``, for a
        layer that ``wants_hidden`` (its callers check): the forward hands them over once, nothing keeps them
        past the step."""
        self.hidden = None if forward is None else forward.hidden.pop(self.layer_idx, None)

    def _defers(self) -> bool:
        """Whether this unpadded one-query step's attention can read the store's codes: a full-attention
        layer whose selector does not narrow what is read (``reads_as_stored``) and asks at most for the
        decode query's probabilities, watched by no probe (a probe reads K/V), over a store with a compact
        read."""
        scores = not self.wants_scores or self.observed_probs == "last"
        return self.window is None and scores and self.probe is None and self.store.attends_codes()

    def end_deferred(self) -> None:
        """An open step ends now (the store's flush), its attention never came: before the next step, or
        before the layer is looked at from outside (``core.rollback`` asks what a crop would change)."""
        self.deferred = False  # a compact read that never ran
        if self.open:
            self.end_step()

    def never_crops(self) -> str | None:
        """Why this layer's selector can never roll back tokens (its state already holds every query's
        effect), or None (``core.rollback``). Selectors whose decisions depend on decode queries say why."""
        return None

    def settle(self) -> None:
        """Carry out work a step left for the next look at the layer (an eviction its attention still read);
        called before the layer is copied or saved."""

    def end_step(self) -> None:
        """The one end of every step, after its last decision: the storage compresses what waited (quantize,
        project); with ``encodes_late``, only after a one-token step (the prompt's parts stay exact while they
        may be evicted: KIVI's per-channel key groups would otherwise be quantized again at every eviction).
        A step ends in ``update`` when nothing after its attention concerns it, else (``open``) in
        ``attended``, or from ``end_deferred`` when its attention never came."""
        self.open = False
        if self.store.flush is not None and not (self.encodes_late and self.step_tokens > 1):
            self.store.flush(self.valid)

    def get_seq_length(self) -> int:
        return self.seen

    # -- positions, for diagnostics ---------------------------------------------------------------
    def watch(self, probe) -> None:
        """Attach ``probe`` (``kvcompress.metrics.fidelity``): ``update`` hands it each step's exact keys and
        values, the attention function what attention read. Turns on position tracking (int32 per stored
        token; not counted in ``memory_bytes`` when only the probe needs it). Only before the first token."""
        if self.seen and not self.track:
            raise ValueError(
                f"layer {self.layer_idx}: watch() before the first update (positions of evicted tokens "
                "are not known afterwards)"
            )
        self.probe, self.probe_only_pos, self.track = probe, not self.track, True

    def positions(self) -> torch.Tensor:
        """Absolute positions (B, 1 or H_kv, T) int32 of the stored tokens, per row and head (padding slots
        hold the position they were consumed at). Needs tracking: a policy that uses them, or ``watch``."""
        if not self.track:
            raise ValueError(
                f"{type(self).__name__} does not track positions; call watch() before the first update"
            )
        if self.pos is None:
            return torch.zeros(1, 1, 0, dtype=torch.int32)
        return self.pos

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.stored_length()
        return stored + query_length, self.seen - stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store.reset()
        self.valid = self._view = self.pos = self.left_pad = None
        self.seen = self.evicted = 0
        self.tail_tokens = self.tail_evicted = 0
        self.tokens_read, self.tokens_visible = 0, 0
        self.backends_ran, self.reads_ran = {}, {}
        self.deferred = self.open = False
        for name in self.per_token + self.per_row:
            setattr(self, name, None)
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.reorder(beam_idx)
        reorder_all(self, ("valid", "pos", "left_pad", *self.per_token, *self.per_row), beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in a row (``num_return_sequences``, contrastive search): every state
        moves as in a beam reorder."""
        b = self._rows()
        if b:
            self._take_rows(torch.arange(b, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Only the rows ``indices`` (their order), every state moving as in a beam reorder."""
        if self._rows():
            idx = torch.as_tensor(indices, device=self.device)
            self._take_rows(idx.nonzero().flatten() if idx.dtype == torch.bool else idx.long())

    def _rows(self) -> int:
        """Rows stored (0 before the first update)."""
        held = [t for t in self.store.tensors() if isinstance(t, torch.Tensor) and t.dim() > 0]
        return held[0].shape[0] if held and self.is_initialized else 0

    def _take_rows(self, idx: torch.Tensor) -> None:
        why = self.store.fixed_rows
        if why:
            raise ValueError(f"{self.policy.name} over storage {self.store.config.name}: {why}")
        self.reorder_cache(idx)

    # -- selection ------------------------------------------------------------------------------
    def stored_length(self) -> int:
        return self.store.length

    @property
    def keys(self) -> torch.Tensor | None:
        """The store's full-precision keys (B, H_kv, T, D): all of them for dense storage, the residual
        window for quant and low_rank."""
        return self.store.keys

    @property
    def values(self) -> torch.Tensor | None:
        return self.store.values

    def keep(self, idx: torch.Tensor, is_sorted: bool = False) -> torch.Tensor:
        """Keep only the tokens ``idx`` (B, 1 or H_kv, k); the storage frees the others.

        Returns the kept indices in stored order (``idx`` sorted unless ``is_sorted`` says it already is).
        """
        before = self.stored_length()
        idx = idx if is_sorted else idx.sort(dim=-1).values
        self.store.keep(idx)
        for name in (
            "valid",
            "pos",
            *self.per_token,
        ):  # shared (B, 1, T) ones turn per head when heads differ
            t = getattr(self, name)
            if t is not None:
                h = max(t.shape[1], idx.shape[1])
                setattr(self, name, t.expand(-1, h, -1).gather(-1, idx.expand(t.shape[0], h, -1)))
        self.evicted += before - idx.shape[-1]
        return idx

    def drop_one(self, slot: torch.Tensor) -> bool:
        """Evict token ``slot`` (B, 1 or H_kv, 1) of every row and head in place, the store moving another
        entry into the hole (``Store.evict_one``; stored order not kept: only for ``order_free`` selectors).
        False, doing nothing, when the storage cannot do it in place or padding is stored."""
        if self.valid is not None:
            return False
        src = self.store.evict_one(slot)
        if src is None:
            return False
        if isinstance(src, int):  # the newest entry moved into the hole
            self.move_newest(slot, ("pos", *self.per_token))
        else:
            self.move_entry(slot, src, ("pos", *self.per_token))
        self.evicted += 1
        return True

    def move_entry(self, slot: torch.Tensor, src: torch.Tensor, names: tuple[str, ...]) -> None:
        """The per-token tensors ``names`` (B, 1 or H_kv, T) follow a store's ``evict_one``: entry ``src``
        (B, 1 or H_kv, 1) moves to ``slot`` (the same shape), then leaves its own place (later entries move
        one down). New tensors: O(T) small per-token entries, none of the cache's keys or values."""
        for name in names:
            x = getattr(self, name)
            if x is None:
                continue
            b, h, t = x.shape[0], max(x.shape[1], src.shape[1]), x.shape[-1]
            x, at, src_h = x.expand(b, h, t), slot.expand(b, h, 1), src.expand(b, h, 1)
            moved = x.scatter(-1, at, x.gather(-1, src_h))  # (B, h, T)
            ar = torch.arange(t - 1, device=x.device)
            setattr(self, name, moved.gather(-1, ar + (ar >= src_h).long()))  # (B, h, T - 1)

    def move_newest(self, slot: torch.Tensor, names: tuple[str, ...]) -> None:
        """The per-token tensors ``names`` (B, 1 or H_kv, T) follow a store's ``drop_one``: the newest entry
        moves to ``slot`` (B, 1 or H_kv, 1) and the last one goes. In place, under the tensor's own inference
        mode (an eviction may be settled after the forward)."""
        for name in names:
            x = getattr(self, name)
            if x is None:
                continue
            if x.shape[1] < slot.shape[1]:
                x = x.expand(-1, slot.shape[1], -1).clone()  # per-row positions turn per head
            t = x.shape[-1]
            with writing(x):
                x.scatter_(-1, slot.expand(-1, x.shape[1], -1), x[..., t - 1 :].clone())
            setattr(self, name, x[..., : t - 1])

    def keep_spans(self, spans: list[tuple[int, int]]) -> None:
        """Keep only the token ranges ``[a, b)`` (the same slots in every row and head)."""
        before = self.stored_length()
        self.store.keep_spans(spans)
        for name in ("valid", "pos", *self.per_token):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.cat([t[..., a:b] for a, b in spans], dim=-1))
        self.evicted += before - self.stored_length()

    # -- bytes and counters ---------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        own = [getattr(self, name) for name in (*self.per_token, *self.per_row)]
        pos = None if self.probe_only_pos else self.pos  # a probe's positions are not the policy's bytes
        return [*self.store.tensors(), self.valid, pos, self.left_pad, *own]

    def memory_bytes(self) -> int:
        return storage_bytes(self.tensors())

    def stats(self) -> dict:
        return {
            "layer": self.layer_idx,
            "policy": self.policy.name,
            "selector": self.policy.selector,
            "tokens_seen": self.seen,
            "tokens_stored": self.stored_length(),
            "tokens_evicted": self.evicted,
            "tokens_read": float(self.tokens_read),
            "tokens_visible": self.tokens_visible,
            "attention_backends": dict(self.backends_ran),
            "attention_reads": dict(self.reads_ran),
            "bytes": self.memory_bytes(),
            **self.store.stats(),
        }

    # -- attention ------------------------------------------------------------------------------
    def plan(self, query, key, value) -> Plan:
        """This step's plan for query (B, H, q, D) over what ``update`` returned (B, H_kv, T, D): the store's
        compact read for a step ``update`` deferred, else the dense read masked from the layer's state."""
        key, value, mask = self.attend(query, key, value)
        probs = self.observed_probs if self.wants_scores else "none"
        if self.deferred:
            return Plan(self.compact_read(), probs, self.grouped_decode)
        if mask is not None:
            mask = expand_heads(mask, query.shape[1])
        return Plan(Dense(key, value, mask), probs, self.grouped_decode)

    def compact_read(self):
        """The deferred step's compact read (``kvcompress.core.plan``): the store's own."""
        return self.store.compact_read()

    def read_deferred(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A deferred step's dense keys/values (B, H_kv, T, D), when its attention cannot read the compact
        form (a selector that deferred its own read, Quest's pages, gathers them)."""
        self.deferred = False
        return self.store.read()

    def compact_done(self) -> None:
        """A deferred step's compact read ran (a selector that deferred its own read counts it)."""
        self.deferred = False

    def dense_plan(self, plan: Plan) -> Plan:
        """The deferred step of ``plan`` as a dense read, where no backend reads its compact form (its
        attention sees the same tokens; the step still ends in ``attended``)."""
        key, value = self.read_deferred()
        return Plan(Dense(key, value, None), plan.probs, plan.grouped)

    def attended(self, plan: Plan, call, out, probs, backend: str) -> None:
        """After attention: count what ran (``backend``, the read's form), show the probe what was read, give
        the selector its scores (``probs``: the decode query's, when the backend computed them) and end the
        step if it waited for this (``open``)."""
        read = plan.read
        self.backends_ran[backend] = self.backends_ran.get(backend, 0) + 1
        self.reads_ran[read.form] = self.reads_ran.get(read.form, 0) + 1
        if read.form != "dense":  # a deferred step: its codes (or pages) were read in place
            self.compact_done()
        elif self.probe is not None:  # fidelity diagnostics, before any eviction
            self.probe.attended(self, call.query, read.key, read.value, read.mask, call.scaling, out)
        if self.wants_scores:  # the decode query's probabilities when it asked (``observed_probs``)
            self.observe_attention(call.query, getattr(read, "key", None), call.scaling, probs)
        if self.open:
            self.end_step()

    def attend(self, query, key, value):
        """What this step's query (B, H, q, D) reads: keys/values (B, H_kv, T, D) and a mask."""
        self.count_read(key.shape[-2])
        return key, value, self.attention_mask(query.shape[2])

    def count_read(self, tokens) -> None:
        """Add a step to the read counters: ``tokens`` its last query read (an int, or a device tensor: the
        mean over rows and KV heads, read on the host only by ``stats``), at most what the model's own
        attention would read then (``visible``), which adds to ``tokens_visible``. ``full`` reads all it
        may: its ``tokens_read`` equals ``tokens_visible`` on every family (``metrics.compression``)."""
        visible = self.seen if self.window is None else self.visible()
        read = tokens.clamp(max=visible) if isinstance(tokens, torch.Tensor) else min(tokens, visible)
        self.tokens_read, self.tokens_visible = self.tokens_read + read, self.tokens_visible + visible

    def visible(self) -> int:
        """Tokens the model's own attention lets the step's last query read: everything consumed, or its
        window (sliding: the last ``window``; chunked: those of its chunk, counted without padding)."""
        if self.window is None:
            return self.seen
        if self.chunked:
            return (self.seen - 1) % self.window + 1
        return min(self.seen, self.window)

    def pass_refusal(self) -> str | None:
        """Why this layer cannot take part in a context pass (``runtime.context_pass``), or None."""
        if self.window is not None and self.track:
            return (
                "a windowed layer whose selector evicts (apply_to=all) cannot take part in a context pass "
                "(its window over evicted tokens is not masked there); use apply_to=full_attention"
            )
        return None

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        """Called after attention when ``wants_scores``. ``probs`` (B, H_kv, 1, T) are the decode step's
        attention probabilities when the attention function already computed them, else None."""

    def scores(self, query, key, scaling: float, window: int, probs=None) -> torch.Tensor:
        """Attention of the last ``window`` queries (B, H_kv, w, T), reusing ``probs`` when they are it."""
        w = min(window, query.shape[2])
        if probs is not None and w == probs.shape[2] and self.valid is None:
            return probs
        return window_scores(query[:, :, -w:], key, scaling, self.valid)

    def attention_mask(self, q: int) -> torch.Tensor | None:
        """Boolean mask (B or 1, 1 or H_kv, q, T) for what ``update`` returned, or None for plain causal.

        Causal by absolute position, within the model's own window (sliding or chunked) on windowed layers,
        and never on padding; a padding query (all masked) may see everything to avoid NaN rows.
        """
        total, valid, pos = self._view
        self._view = (total, None, None)  # drop the transient references
        windowed = self.window is not None and (self.chunked or total > self.window)
        if valid is None and not windowed and (q == 1 or q == total):
            return None
        qpos = (self.seen - q + torch.arange(q, device=self.device)).view(1, 1, q, 1)  # absolute positions
        # untracked positions: the stored tokens read as the latest ones, which is exact for what the mask
        # needs on a full-attention layer (all older tokens precede the step's queries)
        if pos is None:
            kpos = torch.arange(self.seen - total, self.seen, device=self.device).view(1, 1, 1, -1)
        else:
            kpos = pos[:, :, None, :]  # (B, h, 1, T)
        mask = kpos <= qpos  # (B or 1, h, q, T)
        if windowed:
            mask = mask & self._window_mask(kpos, qpos)
        if valid is not None:
            mask = mask & valid[:, :, None, :]
            mask = mask | ~mask.any(-1, keepdim=True)  # padding queries: avoid all-masked rows (NaN)
        return mask

    def _window_mask(self, kpos, qpos):
        """The model's own window: ``kv > q - window`` (sliding) or the same chunk after left padding."""
        if not self.chunked:
            return kpos > qpos - self.window
        pad = 0 if self.left_pad is None else self.left_pad.view(-1, 1, 1, 1)
        return torch.div(kpos - pad, self.window, rounding_mode="floor") == torch.div(
            qpos - pad, self.window, rounding_mode="floor"
        )


def expand_heads(mask: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Per-KV-head masks (B, H_kv, q, T) become (B, H, q, T); shared masks stay (B, 1, q, T)."""
    if mask is None or mask.shape[1] in (1, num_heads):
        return mask
    return mask.repeat_interleave(num_heads // mask.shape[1], dim=1)


def _unread(states: torch.Tensor, total: int) -> torch.Tensor:
    """What ``update`` returns for a deferred step: NaN (B, H_kv, total, D) without storage, so attention
    that is not kvcompress's (which reads the store itself) fails loudly instead of reading a stale copy."""
    b, h, _, d = states.shape
    return torch.full((1, 1, 1, 1), float("nan"), dtype=states.dtype, device=states.device).expand(
        b, h, total, d
    )


def step_inputs(keys: torch.Tensor, args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, object]:
    """What an ``update`` call carries besides keys/values: the model's ``position_ids`` (B or 1, q) the
    step's keys were rotated at, and this forward's ``ForwardState`` (``attention.KEY``), each None where
    absent. transformers 5.x passes the attention's keyword arguments as ``kwargs=...`` (older releases a
    ``cache_kwargs`` dict, positionally or by name); a layer driven by hand names ``positions=`` and
    ``forward=``."""
    positions, forward = kwargs.get("positions"), kwargs.get("forward")
    for extra in (kwargs.get("kwargs"), kwargs.get("cache_kwargs"), *args):
        if not isinstance(extra, dict):
            continue
        forward = extra.get(attention.KEY) if forward is None else forward
        pos = extra.get("position_ids")
        if positions is None and isinstance(pos, torch.Tensor) and pos.ndim == 2:
            positions = pos if pos.shape[-1] == keys.shape[2] else None
    return positions, forward


def _leading_padding(new_valid, batch: int, device) -> torch.Tensor:
    """Left padding of each row (B,) from the first forward's validity (B, q), zeros without padding."""
    if new_valid is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return (new_valid.long().cumsum(-1) == 0).sum(-1)


def _cat_positions(slots, old, seen: int, batch: int, q: int, device) -> torch.Tensor:
    """Absolute positions (B, h, T + q) int32: the stored ones, then ``seen .. seen + q - 1`` (in place in
    the layer's ``slots`` when there is room)."""
    h = 1 if old is None else old.shape[1]
    new = torch.arange(seen, seen + q, dtype=torch.int32, device=device).expand(batch, h, q)
    return new.clone() if old is None else slots.grow("pos", old, new)
