"""Shared machinery of compressed storages: an encoded region followed by a full-precision residual window.

Per row and KV head the stored tokens are ``[encoded (Te) | residual (Tr)]`` in sequence order. New tokens
enter the residual; ``flush`` (end of a step) encodes the oldest ones that left the window. Subclasses
give the codec: ``encode(kind, x, valid, positions)`` turns ``x`` (B, H_kv, n, D) into a tuple of tensors
whose dim 2 is the token axis, ``decode(kind, parts, out, positions)`` writes the reconstruction,
``flush_count`` says how many residual tokens to encode now. A part's dim 1 is H_kv, or fewer when one
latent serves a block of heads (a joint low-rank basis); such blocks must then keep the same tokens.

A codec that needs each token's absolute position (pre-RoPE keys) sets ``needs_positions``: the store then
keeps ``positions`` (B, H_kv, T) int32 aligned with the stored tokens (the model's ``position_ids``, or
consecutive positions when none are given), moved with every eviction and counted in ``tensors()``.

Eviction (``keep``) with a per-token codec gathers encoded rows as they are. The ``k`` kept tokens split
between the two regions by count alone, as a store given only them would hold them (``flush_count(k)``
encoded, the rest in the window), so no eviction reads a value back to the host, every row of a batch keeps
the same layout, and the bytes are those of ``k`` tokens: a kept residual
token that lands in the encoded region is encoded then (once), a kept encoded token that lands in the
window (residual tokens were evicted) is decoded into it (its reconstruction, what attention read
already) and encoded again when it leaves the window.
"""

from __future__ import annotations

import torch

from kvcompress.core.buffers import Slots, gather_tokens, writing
from kvcompress.core.storage import KINDS, Store, take_rows


def shared_heads(idx: torch.Tensor, heads: int) -> torch.Tensor:
    """``idx`` (B, 1 or H, k) as (B, heads, k); each block of ``H // heads`` heads keeps the same tokens."""
    b, h, k = idx.shape
    if h == 1 or h == heads:
        return idx.expand(b, heads, k)
    blocks = idx.reshape(b, heads, h // heads, k)
    if not bool((blocks == blocks[:, :, :1]).all()):
        raise ValueError(
            f"a latent shared by {h // heads} KV heads (low_rank basis=group or joint) cannot keep different "
            "tokens in each head, but the selector evicted per head: use basis=head with this selector"
        )
    return blocks[:, :, 0]


def _gather(part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (B, H, k) of ``part`` (B, H or fewer, T, ...) along dim 2, as a new tensor."""
    shape = part.shape
    idx = shared_heads(idx, shape[1])
    flat = part.reshape(*shape[:3], -1)
    return gather_tokens(flat, idx).view(*shape[:2], idx.shape[-1], *shape[3:])


def _rebuild(like: tuple, items) -> tuple:
    """A tuple of ``items`` of the same type as ``like`` (a named tuple stays one)."""
    return type(like)(*items) if hasattr(like, "_fields") else tuple(items)


class ResidualStore(Store):
    """``encoded[kind]``: tuple of tensors (B, H_kv or fewer, Te, ...) or None; ``residual[kind]``
    (B, H_kv, Tr, D); ``positions`` (B, H_kv, Te + Tr) int32 when the codec ``needs_positions``."""

    needs_positions = False
    grows_in_place = False  # encoded parts in growable buffers (their spare slots count as memory)
    pads_exactly = False  # encoded groups are cut on batch slots: left padding moves a row's group bounds
    # each token is encoded alone (its codes do not depend on other tokens) into parts of H_kv heads: one
    # token can be encoded into an evicted token's slot in place (``evict_one``)
    encodes_per_token = False

    def __init__(self, config, layer_idx, spec, kinds=KINDS):
        super().__init__(config, layer_idx, spec, kinds)
        self.encoded = dict.fromkeys(KINDS)
        self.residual = dict.fromkeys(KINDS)
        self.positions: torch.Tensor | None = None
        self.appended = 0  # tokens appended so far: the positions used when the model gives none
        self.slots = Slots()  # growable buffers of the encoded parts
        self.flushes: list[tuple[int, int, int]] = []  # recent (appended, residual, encoded) per flush (crop)

    # -- codec (subclasses) -----------------------------------------------------------------
    def encode(self, kind: str, x: torch.Tensor, valid=None, positions=None) -> tuple:
        """Encode ``x`` (B, H_kv, n, D); ``valid`` (B, h, n) marks padding tokens (False), or None;
        ``positions`` (B, H_kv, n) when ``needs_positions``."""
        raise NotImplementedError

    def decode(self, kind: str, parts: tuple, out: torch.Tensor, positions=None) -> torch.Tensor:
        raise NotImplementedError

    def flush_count(self, residual: int) -> int:
        raise NotImplementedError

    # -- the Store interface ----------------------------------------------------------------
    def stats(self) -> dict:
        """``encoded_tokens`` (per row and head) and ``exact_window`` (the newest tokens kept in the model's
        dtype, ``recent``): the same two names in every such storage, so a result can say when the window
        held every kept token and nothing was encoded (``metrics.acted``)."""
        window = getattr(self.config, "recent", 0)
        return {**super().stats(), "encoded_tokens": self.encoded_length, "exact_window": window}

    @property
    def encoded_length(self) -> int:
        parts = self.encoded[self.kinds[0]]
        return 0 if parts is None else parts[0].shape[2]

    @property
    def residual_length(self) -> int:
        r = self.residual[self.kinds[0]]
        return 0 if r is None else r.shape[2]

    @property
    def length(self) -> int:
        kind = self.kinds[0]  # both lengths, read here (the step asks for it often)
        parts, r = self.encoded[kind], self.residual[kind]
        return (0 if parts is None else parts[0].shape[2]) + (0 if r is None else r.shape[2])

    def append(self, keys, values, positions=None) -> None:
        for kind, x in zip(KINDS, (keys, values), strict=True):
            if kind in self.kinds:
                old = self.residual[kind]  # the step's tensor itself when the window is empty (never written)
                self.residual[kind] = x if old is None or not old.shape[2] else torch.cat([old, x], dim=2)
        b, h, q, _ = keys.shape
        if self.needs_positions:
            if positions is None:
                positions = torch.arange(self.appended, self.appended + q, device=keys.device)[None]
            new = positions.to(device=keys.device, dtype=torch.int32).view(-1, 1, q).expand(b, h, q)
            old = self.positions  # grown in place when there is room (no copy of every position per step)
            self.positions = new.contiguous() if old is None else self.slots.grow("positions", old, new)
        self.appended += q

    def read(self):
        kinds = self.kinds
        return (
            self._read("keys") if "keys" in kinds else None,
            self._read("values") if "values" in kinds else None,
        )

    def _read(self, kind: str) -> torch.Tensor:
        parts, res = self.encoded[kind], self.residual[kind]
        if parts is None:
            return res
        b, h, tr, d = res.shape
        te = parts[0].shape[2]
        out = torch.empty(b, h, te + tr, d, dtype=res.dtype, device=res.device)
        positions = None if self.positions is None else self.positions[..., :te]
        self.decode(kind, parts, out[:, :, :te], positions)
        out[:, :, te:] = res
        return out

    def _positions(self, start: int, stop: int) -> torch.Tensor | None:
        return None if self.positions is None else self.positions[..., start:stop]

    def flush(self, valid=None) -> None:
        n = self.flush_count(self.residual_length)
        self._log_flush(max(n, 0))
        if n <= 0:
            return
        te = self.encoded_length
        valid = None if valid is None else valid[..., te : te + n]
        for kind in self.kinds:
            res = self.residual[kind]
            self._extend(kind, self.encode(kind, res[:, :, :n], valid, self._positions(te, te + n)))
            rest = res[:, :, n:]  # a copy (or nothing): the encoded tokens' floats are freed
            self.residual[kind] = rest.clone() if rest.shape[2] else res.new_empty(rest.shape)

    def _log_flush(self, n: int) -> None:
        """Note this flush (tokens appended, residual length, tokens encoded) for ``crop_refusal``. An entry
        matters while the tokens that came after it fit in the window; ``appended - residual`` never
        decreases, so one that stops mattering never matters again and is dropped."""
        r = self.residual_length
        self.flushes = [f for f in self.flushes if self.appended - f[0] < r - n] + [(self.appended, r, n)]

    def crop_refusal(self, n: int) -> str | None:
        """None when the newest ``n`` tokens are still exact in the residual window and every flush since
        they came would have encoded as many tokens without them (so the window then holds what the policy
        promises); else why not."""
        if n > self.residual_length:
            return (
                f"the newest {n} tokens are not all in the exact residual window of "
                f"{self.residual_length} (older ones are {self.config.name}-encoded)"
            )
        start = self.appended - n
        for at, r, encoded in self.flushes:
            m = at - start  # of the removed tokens, those this flush saw
            if m > 0 and max(0, self.flush_count(r - m)) != encoded:
                return (
                    "they pushed older tokens out of the exact residual window into the encoded region, "
                    "which cannot be undone exactly"
                )
        return None

    def crop_conditions(self) -> list[str]:
        return ["the rejected tokens made no older token leave the exact residual window"]

    def crop(self, n: int) -> None:
        """Cut the window's newest ``n`` tokens (a copy: their floats are freed); the flushes that saw them
        are noted as they would have been without them."""
        tr, start = self.residual_length - n, self.appended - n
        for kind in self.kinds:
            self.residual[kind] = self.residual[kind][:, :, :tr].clone()
        if self.positions is not None:
            self.positions = self.positions[..., : self.positions.shape[-1] - n]
        self.flushes = [(min(at, start), r - max(0, at - start), e) for at, r, e in self.flushes]
        self.appended = start

    def _extend(self, kind: str, new: tuple) -> None:
        """Append newly encoded tokens: with ``grows_in_place`` into a growable buffer (``buffers.Slots``,
        up to 1/128 spare slots, counted), so a decode step does not copy every encoded token as
        ``torch.cat`` does."""
        old = self.encoded[kind]
        if old is None:
            self.encoded[kind] = new
            return
        pairs = enumerate(zip(old, new, strict=True))
        if self.grows_in_place:
            joined = [self.slots.extend(f"{kind}{i}", a, b) for i, (a, b) in pairs]
        else:
            joined = [torch.cat([a, b], dim=2) for _, (a, b) in pairs]
        self.encoded[kind] = _rebuild(new, joined)

    def keep(self, idx) -> None:
        """Keep tokens ``idx`` (B, 1 or H_kv, k) ascending, laid out (once encoding began) as a store that had
        only ever been given these ``k`` tokens: the first ``flush_count(k)`` encoded, the rest in the
        window. Both lengths follow from ``k`` alone, so no value is read back to the host, and the bytes are
        what the memory model predicts for ``k`` tokens. A kept residual token that falls in the encoded
        region is encoded now (once); a kept encoded token that falls in the window (residual tokens were
        evicted) is decoded into it: its reconstruction, the values attention read already."""
        te, tr, k = self.encoded_length, self.residual_length, idx.shape[-1]
        # nothing encoded yet: all stay exact, and the layer's flush encodes them when it may (a prompt that
        # a prefill-time selector may still evict stays exact until then)
        n_enc = 0 if te == 0 else max(0, min(k, self.flush_count(k)))
        n_res = k - n_enc
        # at most tr - n_res kept residual tokens land in the encoded region (its last positions), at most
        # te - n_enc kept encoded ones in the window (its first): only those are encoded or decoded
        late, early = max(0, min(n_enc, tr - n_res)), max(0, min(n_res, te - n_enc))
        if self.positions is not None:
            self.positions = self.positions.gather(-1, idx.expand(*self.positions.shape[:2], -1))
        for kind in self.kinds:
            res = self.residual[kind]
            kept = self._take_residual(kind, idx[..., n_enc:], te, res, early)  # reads the encoded parts
            self.encoded[kind] = self._take_encoded(kind, idx[..., :n_enc], te, res, late) if n_enc else None
            self.residual[kind] = kept

    def can_evict_one(self) -> bool:
        return self.encodes_per_token and not self.needs_positions and self.encoded_length > 0

    def evict_one(self, slot: torch.Tensor) -> torch.Tensor | None:
        """A decode step's one eviction in place, where the layout ``keep`` gives the ``k`` tokens left is
        the one already held (the first ``flush_count(k)`` encoded): a hole in the encoded region takes the
        window's oldest token, encoded now into it (the token ``keep`` would encode), and the window loses
        that token, or the evicted one where the hole is in the window. O(window), no copy of the codes.
        Returns the stored index whose entry moved into ``slot``, shaped as ``slot`` (``Store.evict_one``)."""
        te, tr = self.encoded_length, self.residual_length
        k = te + tr - 1
        if not self.encodes_per_token or self.needs_positions or te == 0 or tr == 0:
            return None
        if max(0, min(k, self.flush_count(k))) != te:
            return None
        b, h = self.residual[self.kinds[0]].shape[:2]
        at = slot.expand(b, h, 1)
        hole = at < te  # (B, H_kv, 1): the evicted token is encoded
        gone = torch.where(hole, 0, at - te)  # (B, H_kv, 1): the window's token that leaves it
        ar = torch.arange(tr - 1, device=at.device)
        stay = ar + (ar >= gone).long()  # (B, H_kv, tr - 1)
        for kind in self.kinds:
            res = self.residual[kind]  # (B, H_kv, tr, D)
            self._fill_hole(kind, at.clamp(max=te - 1), hole, self.encode(kind, res[:, :, :1]))
            self.residual[kind] = gather_tokens(res, stay)
        return torch.where(slot < te, te, slot)  # (B, 1 or H_kv, 1): heads that share a slot share it

    def _fill_hole(self, kind: str, at: torch.Tensor, hole: torch.Tensor, fresh: tuple) -> None:
        """Write the encoded token ``fresh`` (parts (B, H_kv, 1, ...)) at ``at`` (B, H_kv, 1) where ``hole``
        (elsewhere each part keeps its own entry)."""
        parts = self.encoded[kind]
        with writing(parts[0]):
            for part, new in zip(parts, fresh, strict=True):
                tail = (1,) * (part.dim() - 3)
                idx = at.view(*at.shape, *tail).expand(*at.shape, *part.shape[3:])
                part.scatter_(2, idx, torch.where(hole.view(*hole.shape, *tail), new, part.gather(2, idx)))

    def _take_encoded(self, kind: str, head: torch.Tensor, te: int, res: torch.Tensor, m: int) -> tuple:
        """Encoded rows ``head`` (B, 1 or H, n); positions past ``te`` are residual tokens, encoded now. Only
        the last ``m`` positions can be such (``keep``'s bound), so only they are encoded."""
        parts = self.encoded[kind]
        old = [_gather(p, head.clamp(max=te - 1)) for p in parts]
        if m == 0:
            return _rebuild(parts, old)
        last, n = head[..., -m:], head.shape[-1]  # (B, 1 or H, m)
        pos = self._positions(n - m, n)  # already the kept tokens' positions
        rows = (last - te).clamp(min=0).expand(*res.shape[:2], -1)
        fresh = self.encode(kind, gather_tokens(res, rows), None, pos)
        late = last >= te
        for o, f in zip(old, fresh, strict=True):
            mask = shared_heads(late, o.shape[1])
            tail = o[:, :, n - m :]
            tail.copy_(torch.where(mask.view(*mask.shape, *([1] * (o.dim() - 3))), f, tail))
        return _rebuild(parts, old)

    def _take_residual(
        self, kind: str, tail: torch.Tensor, te: int, res: torch.Tensor, d: int
    ) -> torch.Tensor:
        """The window after eviction: kept tokens ``tail`` (B, 1 or H, n); those before ``te`` are encoded
        tokens, decoded here (their reconstruction). Only the first ``d`` positions can be such
        (``keep``'s bound), so only they are decoded."""
        kept = gather_tokens(res, (tail - te).clamp(min=0).expand(*res.shape[:2], -1))  # (B, H, n, D)
        if d == 0:
            return kept
        first, parts = tail[..., :d], self.encoded[kind]
        rows = [_gather(p, first.clamp(max=te - 1)) for p in parts]
        start = self.positions.shape[-1] - tail.shape[-1] if self.positions is not None else 0
        decoded = self.decode(kind, _rebuild(parts, rows), torch.empty_like(kept[:, :, :d]),
                              self._positions(start, start + d))  # fmt: skip
        head = kept[:, :, :d]
        head.copy_(torch.where((first < te)[..., None], decoded, head))
        return kept

    def reorder(self, beam_idx) -> None:
        for kind in self.kinds:
            self.residual[kind] = take_rows(self.residual[kind], beam_idx)
            self.encoded[kind] = take_rows(self.encoded[kind], beam_idx)
        self.positions = take_rows(self.positions, beam_idx)

    def reset(self) -> None:
        self.slots.clear()
        self.encoded = dict.fromkeys(KINDS)
        self.residual = dict.fromkeys(KINDS)
        self.positions, self.appended = None, 0
        self.flushes = []

    def tensors(self):
        parts = [t for kind in self.kinds if self.encoded[kind] is not None for t in self.encoded[kind]]
        return [*parts, *self.residual.values(), self.positions, *self.fixed_tensors()]
