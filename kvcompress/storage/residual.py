"""Shared machinery of compressed storages: an encoded region followed by a full-precision residual window.

Per row and KV head the stored tokens are ``[encoded (Te) | residual (Tr)]`` in sequence order. New tokens
enter the residual; ``flush`` (end of a step) encodes the oldest ones that left the window. Subclasses
give the codec: ``encode(kind, x)`` turns ``x`` (B, H_kv, n, D) into a tuple of tensors whose dim 2 is the
token axis, ``decode(kind, parts, out)`` writes the reconstruction, ``flush_count`` says how many residual
tokens to encode now.

Eviction (``keep``) with a per-token codec is exact: encoded rows are gathered, never re-encoded. Rows and
heads may keep different numbers of encoded tokens; all then keep the largest such count, so in the others
a few residual tokens are encoded earlier than the window says (each token is still encoded once).
"""

from __future__ import annotations

import torch

from kvcompress.storage.base import Store
from kvcompress.storage.buffers import gather_tokens

KINDS = ("keys", "values")


def _gather(part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (B, H, k) of ``part`` (B, H, T, ...) along dim 2, as a new tensor."""
    shape = part.shape
    flat = part.reshape(*shape[:3], -1)
    return gather_tokens(flat, idx).view(*shape[:2], idx.shape[-1], *shape[3:])


def _encoded_kept(idx: torch.Tensor, te: int) -> int:
    """Encoded tokens that stay: the most any head keeps. Heads of a row may differ (the others encode a
    few residual tokens early); rows may not, or a row's result would depend on the rest of its batch."""
    if te == 0:
        return 0
    per_row = (idx < te).sum(-1).amax(-1)  # (B,)
    if bool((per_row != per_row[0]).any()):
        raise ValueError(
            f"batch rows keep {per_row.tolist()} encoded tokens after eviction (padding or rows that "
            "diverge): over quant or low_rank storage an evicting selector compresses each row on its own "
            "only when all rows keep as many; run one sequence per batch (no padding) or use dense storage"
        )
    return int(per_row[0])


class ResidualStore(Store):
    """``encoded[kind]``: tuple of tensors (B, H_kv, Te, ...) or None; ``residual[kind]`` (B, H_kv, Tr, D)."""

    def __init__(self, config, layer_idx, spec):
        super().__init__(config, layer_idx, spec)
        self.encoded = dict.fromkeys(KINDS)
        self.residual = dict.fromkeys(KINDS)

    # -- codec (subclasses) -----------------------------------------------------------------
    def encode(self, kind: str, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple:
        """Encode ``x`` (B, H_kv, n, D); ``valid`` (B, h, n) marks padding tokens (False), or None."""
        raise NotImplementedError

    def decode(self, kind: str, parts: tuple, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def flush_count(self, residual: int) -> int:
        raise NotImplementedError

    # -- the Store interface ----------------------------------------------------------------
    @property
    def encoded_length(self) -> int:
        parts = self.encoded["keys"]
        return 0 if parts is None else parts[0].shape[2]

    @property
    def residual_length(self) -> int:
        r = self.residual["keys"]
        return 0 if r is None else r.shape[2]

    @property
    def length(self) -> int:
        return self.encoded_length + self.residual_length

    def append(self, keys, values) -> None:
        for kind, x in zip(KINDS, (keys, values), strict=True):
            old = self.residual[kind]
            self.residual[kind] = x if old is None else torch.cat([old, x], dim=2)

    def read(self):
        return tuple(self._read(kind) for kind in KINDS)

    def _read(self, kind: str) -> torch.Tensor:
        parts, res = self.encoded[kind], self.residual[kind]
        if parts is None:
            return res
        b, h, tr, d = res.shape
        te = parts[0].shape[2]
        out = torch.empty(b, h, te + tr, d, dtype=res.dtype, device=res.device)
        self.decode(kind, parts, out[:, :, :te])
        out[:, :, te:] = res
        return out

    def flush(self, valid=None) -> None:
        n = self.flush_count(self.residual_length)
        if n <= 0:
            return
        te = self.encoded_length
        valid = None if valid is None else valid[..., te : te + n]
        for kind in KINDS:
            res = self.residual[kind]
            self._extend(kind, self.encode(kind, res[:, :, :n], valid))
            self.residual[kind] = res[:, :, n:].clone()  # a copy: the encoded tokens' floats are freed

    def _extend(self, kind: str, new: tuple) -> None:
        old = self.encoded[kind]
        joined = (
            new if old is None else tuple(torch.cat([a, b], dim=2) for a, b in zip(old, new, strict=True))
        )
        self.encoded[kind] = type(new)(*joined) if hasattr(new, "_fields") else joined

    def keep(self, idx) -> None:
        b, h = self.residual["keys"].shape[:2]
        idx = idx.expand(b, h, -1)
        te = self.encoded_length
        n_enc = _encoded_kept(idx, te)
        head, tail = idx[..., :n_enc], idx[..., n_enc:] - te  # tail: residual positions only
        for kind in KINDS:
            res = self.residual[kind]
            if n_enc:
                self.encoded[kind] = self._take_encoded(kind, head, te, res)
            else:
                self.encoded[kind] = None
            self.residual[kind] = gather_tokens(res, tail)

    def _take_encoded(self, kind: str, head: torch.Tensor, te: int, res: torch.Tensor) -> tuple:
        """Encoded rows ``head`` (B, H, n); positions past ``te`` are residual tokens encoded now."""
        parts = self.encoded[kind]
        old = [_gather(p, head.clamp(max=te - 1)) for p in parts]
        late = head >= te
        if not bool(late.any()):
            return type(parts)(*old) if hasattr(parts, "_fields") else tuple(old)
        fresh = self.encode(kind, gather_tokens(res, (head - te).clamp(min=0)))
        mixed = []
        for o, f in zip(old, fresh, strict=True):
            m = late.view(*late.shape, *([1] * (o.dim() - 3)))
            mixed.append(torch.where(m, f, o))
        return type(parts)(*mixed) if hasattr(parts, "_fields") else tuple(mixed)

    def reorder(self, beam_idx) -> None:
        for kind in KINDS:
            self.residual[kind] = self.residual[kind].index_select(0, beam_idx.to(self.residual[kind].device))
            parts = self.encoded[kind]
            if parts is not None:
                moved = [p.index_select(0, beam_idx.to(p.device)) for p in parts]
                self.encoded[kind] = type(parts)(*moved) if hasattr(parts, "_fields") else tuple(moved)

    def reset(self) -> None:
        self.encoded = dict.fromkeys(KINDS)
        self.residual = dict.fromkeys(KINDS)

    def tensors(self):
        parts = [t for kind in KINDS if self.encoded[kind] is not None for t in self.encoded[kind]]
        return [*parts, *self.residual.values(), *self.fixed_tensors()]
