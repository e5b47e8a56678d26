"""Shared machinery of score-based eviction (H2O, SnapKV, TOVA): budgets, per-row/per-head top-k.

A policy keeps either a fixed ``budget`` of tokens per layer and KV head, removes a fraction
``compression_ratio`` of the tokens seen (kvpress's definition), or keeps the pairs scoring at least a
``threshold`` (``when``); ``evict_at`` says whether it evicts at prefill only or at every step. Its layer
turns attention scores into a per-token priority and keeps the top ``k`` per batch row and head with
``PolicyLayer.keep``, which frees the evicted tokens' storage. Every head keeps the same count (a threshold
or ``adaptive`` excepted: the flat layout of ``adaptive``), so no ragged masks are needed;
padding slots (``PolicyLayer.valid``) are never kept over real tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcompress.core.fields import Bool, Choice, Float, Int
from kvcompress.core.layer import PolicyLayer
from kvcompress.core.policy import Policy, Shape
from kvcompress.selectors.eviction import adaptive as ada
from kvcompress.selectors.eviction.chunks import chunk_priority
from kvcompress.selectors.eviction.spans import span_pool
from kvcompress.selectors.eviction.when import EVICT_AT, check_one_budget, threshold_pairs, when_refusal

UNITS = ("token", "chunk")
_BIG = 1e12  # priority offset: protected tokens above every score, padding below every score

# Fuzz alternatives shared by budgeted policies: a fixed budget or a ratio.
BUDGETS = [
    {"budget": (1, 40), "compression_ratio": None},
    {"budget": None, "compression_ratio": [0.0, 0.3, 0.5, 0.75, 0.95]},
]
BUDGET_FUZZ = [{**alt, "unit": list(UNITS), "chunk_size": (1, 8), "span": (1, 6)} for alt in BUDGETS]


@dataclass
class EvictionPolicy(Policy):
    """Base of eviction policies: one of ``budget`` (tokens kept per layer and head) or
    ``compression_ratio`` (fraction of the tokens seen that is removed, in [0, 1); 0.5 if neither is set).
    ``unit``: ``token`` keeps the best tokens; ``chunk`` keeps whole chunks of ``chunk_size`` consecutive
    tokens ranked by their summed scores (ChunkKV, Liu et al., arXiv 2502.00299).

    Args:
        budget: tokens kept per layer and KV head; null: use compression_ratio.
        compression_ratio: fraction of the tokens seen that is removed, in [0, 1).
        unit: token: keep the best tokens; chunk: keep whole chunks by their summed scores.
        chunk_size: consecutive tokens per chunk when unit is chunk.
        span: each token ranks with the best token of any run of span adjacent tokens it is in, so runs
            are kept together (a multi-token value with its first token); 1: every token on its own.
        adaptive: share each layer's budget among its KV heads by score (Ada-KV, arXiv 2407.11550), each
            head really storing its own number of tokens (``eviction.adaptive``); selectors that evict the
            prompt once, over dense storage.
        adaptive_floor: with adaptive, the fraction of the per-head budget every head keeps at least.
        threshold: instead of budget / compression_ratio: keep the pairs whose priority (the selector's own
            score, docs/policies.md) is at least this, per layer and KV head, plus protected tokens; heads
            keep their own counts (``when``). Dense storage, batch 1; at decode steps (evict_at=always)
            only for selectors that score each head's own pairs (h2o, tova, kvzap).
        threshold_every: with a threshold and evict_at=always, a flat layer evicts every this many tokens
            seen (each time reading its kept count back to the host once); 1: at every decode step.
        evict_at: prefill: evict at steps of several tokens only (decode tokens are appended); always: at
            decode steps too. Each selector defaults to its paper's choice.
    """

    prefill_only: ClassVar[str | None] = None  # why this selector cannot evict at decode steps, or None
    adaptive_decode = False  # adaptive: true also at decode steps, scored by the decode query (h2o, tova)
    FUZZ = BUDGET_FUZZ

    budget: int | None = Int(None, low=1, null=True)
    compression_ratio: float | None = Float(None, 0.0, 1.0, high_open=True, null=True)
    unit: str = Choice("token", UNITS)
    chunk_size: int = Int(10, low=1)
    span: int = Int(1, low=1)
    adaptive: bool = Bool(False)
    adaptive_floor: float = Float(0.2, 0.0, 1.0)
    threshold: float | None = Float(None, -1e6, 1e6, null=True)
    evict_at: str = Choice("always", EVICT_AT)  # a prompt-only selector declares "prefill"
    threshold_every: int = Int(32, low=1)

    def __post_init__(self):
        check_one_budget(self)
        super().__post_init__()
        why = when_refusal(self) or (self.flat_heads and ada.refusal(self, self.storage.name, None))
        if why:
            raise ValueError(why)

    @property
    def evicts(self) -> str:
        return self.evict_at

    @property
    def flat_heads(self) -> bool:
        """Whether KV heads keep their own counts (``adaptive`` or ``threshold``): the flat layout."""
        return self.adaptive or self.threshold is not None

    def check(self, spec) -> None:
        super().check(spec)
        windowed = [i for i in range(spec.num_layers) if spec.window(i) is not None]
        if self.flat_heads and self.apply_to == "all" and windowed:
            raise ValueError(ada.refusal(self, self.storage.name, spec.window(windowed[0])))

    def layer_type(self) -> type:
        """The layer class: ``adaptive.variant`` of ``layer_class`` where heads keep their own counts."""
        return ada.variant(self.layer_class) if self.flat_heads else self.layer_class

    keep_rule = None  # a callable n_tokens -> kept that overrides budget / ratio (a PyramidKV layer's share)

    def keep_count(self, n_tokens: int) -> int:
        """Tokens a layer keeps per head after seeing ``n_tokens`` real tokens (at least 1). With a threshold
        it is no count but a cap below ``n_tokens``, so that every step of several tokens is ranked."""
        if self.threshold is not None:
            return max(1, n_tokens - 1)
        if self.keep_rule is not None:
            return self.keep_rule(n_tokens)
        if self.budget is not None:
            return self.budget
        return max(1, int(n_tokens * (1.0 - self.compression_ratio) + 1e-9))

    @property
    def reserved(self) -> int:
        """Tokens every layer keeps whatever the scores (e.g. SnapKV's observation window)."""
        return 0

    def covering(self, n_tokens: int) -> EvictionPolicy:
        out = super().covering(n_tokens)
        if self.threshold is not None:
            return dataclasses.replace(out, threshold=None, compression_ratio=0.0)
        if self.budget is not None:
            return dataclasses.replace(out, budget=max(self.budget, n_tokens))
        return dataclasses.replace(out, compression_ratio=0.0)

    def kept_tokens(self, s: Shape) -> int:
        """``evict_at: always`` enforces its target at every step: ``min(T, keep_count(T))`` (``keep_count``
        grows by at most one token per token seen, so a decode step never leaves more); ``prefill``
        compresses the prompt to ``min(n, keep_count(n))`` and appends the decode tokens."""
        if self.evict_at == "prefill":
            return min(s.prefill, self.keep_count(s.prefill)) + s.decode
        return min(s.total, self.keep_count(s.total))

    def layer_parts(self, s: Shape, layer_idx: int):
        """None with a threshold: how many pairs pass it depends on the scores (no guess)."""
        return None if self.threshold is not None else super().layer_parts(s, layer_idx)


class EvictionLayer(PolicyLayer):
    """A layer that evicts from attention scores (``observe_attention``) instead of ``compress``. With
    ``adaptive: true`` its policy builds ``adaptive.variant`` of the class instead (``adaptive`` True)."""

    adaptive = False  # head-adaptive budgets (``adaptive.AdaptiveHeads``): ``select_heads`` ranks pairs
    reads_as_stored = False  # with evict_at=always: scored from dense K/V at decode steps (see ``__init__``)
    flat = False  # whether heads hold their own pairs now (``AdaptiveHeads.flat``)

    per_row = ("row_padding",)  # (B,) padding tokens consumed by each row

    def __init__(self, policy, layer_idx, spec, store):
        self.decode_evicts = policy.evicts == "always"  # read by ``wants_scores`` at every step
        # a decode step that evicts nothing asks attention for nothing, so it may read the codes as ``full``
        # does; one that evicts reads dense K/V (in the grouped form where it is one) unless the selector
        # scores from the decode query's probabilities alone (h2o, tova: their class says so)
        self.reads_as_stored = type(self).reads_as_stored or not self.decode_evicts
        super().__init__(policy, layer_idx, spec, store)
        self.padding_seen = 0  # padding tokens consumed by the least padded row
        self.unit = getattr(policy, "unit", "token")  # block_evict ranks its own blocks
        self.span = getattr(policy, "span", 1)  # runs kept together (``spans``)
        self.threshold = getattr(policy, "threshold", None)  # block_evict sizes by its own blocks
        if self.unit == "chunk" or self.span > 1:  # runs of stored tokens: stored order stays sequence order
            self.order_free = False

    def on_append(self, key_states, new_valid) -> None:
        if new_valid is not None:
            pad = (~new_valid).sum(-1)  # (B,)
            self.padding_seen += int(pad.min())
            self.row_padding = pad if self.row_padding is None else self.row_padding + pad

    def reset(self) -> None:
        super().reset()
        self.padding_seen = 0

    def never_crops(self) -> str | None:
        """A selector that evicts at decode steps decides from every query, the rejected candidates' too."""
        if self.policy.evicts == "always":
            return (
                f"{self.policy.selector} decides evictions from every query's attention at decode steps, so "
                "a rejected candidate's queries have already shaped what is kept"
            )
        return None

    def row_targets(self, k: int) -> torch.Tensor | None:
        """Tokens each row keeps (B, 1, 1) when a ratio sizes rows that have seen padding (each row from its
        own real tokens, at most ``k``), as a device tensor: whether they all equal ``k`` is never read back
        (a row keeping ``k`` marks nothing); None with a fixed budget or no padding ever seen."""
        if self.policy.budget is not None or self.row_padding is None:
            return None
        real = (self.seen - self.row_padding).double()
        rule = getattr(self.policy, "keep_rule", None)  # block_evict's policy is no EvictionPolicy
        if rule is not None:  # a prefill's rows, each sized by the rule on its own length
            own = torch.tensor([rule(int(n)) for n in real.tolist()], device=real.device)
            return own.clamp(min=1, max=k).view(-1, 1, 1)
        own = (real * (1.0 - self.policy.compression_ratio) + 1e-9).floor().long().clamp(min=1, max=k)
        return own.view(-1, 1, 1)

    def due(self) -> bool:
        """Whether this step evicts: the layer holds more than its target, or, for a flat layer with a
        threshold, the step has several tokens or ends a run of ``threshold_every`` tokens (``when``)."""
        if self.threshold is not None and self.flat:
            return self.step_tokens > 1 or self.seen % self.policy.threshold_every == 0
        return self.stored_length() > self.target()

    def target(self) -> int:
        """Tokens to keep now: the budget, or a fraction of the longest row's real tokens."""
        return self.policy.keep_count(self.seen - self.padding_seen)

    def token_order(self, t: int, device) -> torch.Tensor:
        """Sequence order of the stored tokens (newest highest): the stored index, or a layer's own
        positions when a decode step's in-place eviction reorders its tokens (H2O)."""
        return torch.arange(t, device=device, dtype=torch.float64)

    def first_real(self, n: int, t: int, device) -> torch.Tensor:
        """(B or 1, 1 or H_kv, T) bool: the first ``n`` real stored tokens of each row (attention sinks)."""
        if self.valid is None:
            return (torch.arange(t, device=device) < n)[None, None]
        return self.valid & (self.valid.cumsum(-1) <= n)

    def select(
        self,
        scores: torch.Tensor,
        k: int,
        protect: int = 0,
        pinned: torch.Tensor | None = None,
        refill: bool = True,
    ) -> torch.Tensor:
        """Keep the ``k`` best tokens of every row and head; returns the kept indices (B, h, k), sorted.

        With ``unit: chunk`` whole chunks of ``chunk_size`` stored tokens are kept, ranked by their summed
        scores (``chunks.chunk_priority``); the last one taken may be partial, so exactly ``k`` stay.

        Args:
            scores: (B, 1 or H_kv, T) priority of each stored token (higher is kept).
            protect: the last ``protect`` positions are kept first (recent / observation window).
            pinned: (B or 1, 1 or H_kv, T) bool, tokens kept first whatever their score (sinks, H2O's
                recent window); among kept-first tokens the newest win ties (``token_order``).
            refill: a decode step's one eviction may move the newest token into the hole (``drop_one``, for
                ``order_free`` selectors); False where the caller already tried that this step (H2O).
        """
        t = scores.shape[-1]
        protect *= self.spec.num_kv_heads if self.flat else 1  # flat: the last tokens' pairs, token-major
        order = self.token_order(t, scores.device)
        first = pinned if pinned is not None else torch.zeros(1, 1, t, dtype=torch.bool, device=scores.device)
        if protect:
            first = first | (torch.arange(t, device=scores.device) >= t - protect)
        prio = scores.double()
        if self.span > 1:
            prio = span_pool(prio, self.span, ~first if self.valid is None else ~first & self.valid)
        if self.unit == "chunk":
            prio = chunk_priority(prio, self.policy.chunk_size, self.valid, ~first)
        prio = torch.where(first, _BIG + order, prio)
        if self.threshold is not None:  # each head its own count (``when``)
            if self.flat:
                return self.flat_threshold(prio)
            h, name = self.spec.num_kv_heads, self.policy.name
            return self.flatten(threshold_pairs(prio.expand(-1, h, -1), self.threshold, name))
        if self.adaptive:  # one ranking of all (token, head) pairs (Ada-KV)
            return self.select_heads(prio, k)
        if t - k == 1 and self.valid is None and protect < t:  # decode: drop one token, no top-k or sort
            worst = prio[..., : t - protect].argmin(dim=-1, keepdim=True)  # (B, h, 1)
            in_place = refill and self.order_free and protect == 0
            if in_place and self.store.can_evict_one() and self.drop_one(worst):
                return worst
            ar = torch.arange(t - 1, device=scores.device)
            idx = ar + (ar >= worst).long()  # (B, h, t - 1): every position but the worst, in order
            return self.keep(idx, is_sorted=True)
        if self.valid is not None:
            prio = torch.where(self.valid, prio, -_BIG + order)  # padding only fills what real tokens cannot
        top = prio.topk(min(k, t), dim=-1).indices  # (B, h, k), best first
        own = self.row_targets(top.shape[-1])
        if own is None:
            return self.keep(top)  # sorted by keep
        idx, rank = top.sort(dim=-1)
        extra = (rank >= own).expand(-1, idx.shape[1], -1)  # slots beyond a row's own target: padding
        idx = self.keep(idx, is_sorted=True)
        self.valid = self.valid.expand(-1, idx.shape[1], -1) & ~extra
        return idx

    @property
    def wants_scores(self) -> bool:
        """Scores after attention (``observe_attention``) at every step of several tokens, and at decode
        steps only for a selector that evicts then (``evicts: always``): with ``evict_at: prefill`` a decode
        step asks attention for nothing and evicts nothing, whatever the selector's own code does."""
        return self.step_tokens > 1 or self.decode_evicts

    def stats(self) -> dict:
        heads = [self.stored_length()] * self.spec.num_kv_heads  # flat layers report their own counts
        return {**super().stats(), "target": self.target(), "evict_at": self.policy.evicts,
                "tokens_per_head": heads}  # fmt: skip
