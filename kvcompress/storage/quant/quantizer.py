"""Asymmetric min/max group quantization into packed integer codes: the storage of the ``quant`` policy.

An element is stored as an unsigned code ``c`` in ``[0, 2**bits - 1]`` and read back as
``zero + scale * c``, one ``(scale, zero)`` pair per group of ``G`` elements. The grouping axis follows
KIVI (Liu et al., arXiv 2402.02750): ``"channel"`` groups ``G`` consecutive tokens of one channel (keys,
whose outlier channels would ruin a shared scale), ``"token"`` groups ``G`` consecutive channels of one
token (values). Codes are packed along the head dimension: int8 one a byte, int4 two, int2 four.

``zero`` is rounded down and ``scale`` up to their storage dtype, so ``zero + scale * (2**bits - 1)``
still covers the group's maximum and every element is within ``scale / 2`` of its reconstruction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BITS = (2, 4, 8)
AXES = ("channel", "token")


class QuantizedTensor(NamedTuple):
    """Packed codes plus per-group parameters of a ``(B, H, T, D)`` tensor (T a multiple of G for channel)."""

    codes: torch.Tensor  # (B, H, T, D * bits / 8) uint8
    scale: torch.Tensor  # channel: (B, H, T / G, D); token: (B, H, T, D / G)
    zero: torch.Tensor  # same shape as scale


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (..., D) below ``2**bits`` into (..., D * bits / 8) bytes.

    Block layout: bits ``[bits * k, bits * (k + 1))`` of byte ``j`` hold channel ``k * D * bits / 8 + j``, so
    each bit plane unpacks into one contiguous block of channels (faster to read than interleaved codes).
    """
    per = 8 // bits
    if per == 1:
        return codes
    blocks = codes.chunk(per, dim=-1)  # per x (..., D / per)
    out = blocks[0].clone(memory_format=torch.contiguous_format)
    for k in range(1, per):
        out |= blocks[k] << (bits * k)
    return out


def _planes(packed: torch.Tensor, bits: int):
    """The ``8 / bits`` bit planes of ``packed`` (..., D / per) as uint8 codes, lowest first."""
    per, mask = 8 // bits, (1 << bits) - 1
    for k in range(per):
        plane = packed >> (bits * k) if k else packed
        yield plane & mask if k < per - 1 else plane


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack``: bytes (..., D * bits / 8) to uint8 codes (..., D)."""
    return packed if bits == 8 else torch.cat(list(_planes(packed, bits)), dim=-1)


def _round(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, rounded toward +inf (``up``) or -inf instead of to nearest."""
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    off = y.float() < x if up else y.float() > x
    toward = torch.full_like(y, float("inf") if up else float("-inf"))
    return torch.where(off, torch.nextafter(y, toward), y)


def _grouped(x: torch.Tensor, group: int, axis: str) -> tuple[torch.Tensor, int]:
    """A view of x (B, H, T, D) with groups on their own dim, and that dim's index."""
    b, h, t, d = x.shape
    if axis == "channel":
        return x.view(b, h, t // group, group, d), 3  # (B, H, T/G, G, D)
    return x.view(b, h, t, d // group, group), 4  # (B, H, T, D/G, G)


def _min_max(g: torch.Tensor, dim: int, valid: torch.Tensor | None):
    """Per-group min/max over ``dim``; tokens where ``valid`` (B, h, T) is False (padding) are ignored."""
    if valid is None or dim != 3:  # per-token groups never mix a padding token with a real one
        return g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
    v = valid.reshape(valid.shape[0], valid.shape[1], g.shape[2], g.shape[3], 1)  # (B, h, T/G, G, 1)
    lo = g.masked_fill(~v, float("inf")).amin(dim, keepdim=True)
    hi = g.masked_fill(~v, float("-inf")).amax(dim, keepdim=True)
    empty = lo > hi  # groups made only of padding
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


def quantize(x, bits: int, group: int, axis: str, scale_dtype: torch.dtype, valid=None) -> QuantizedTensor:
    """Quantize x (B, H, T, D) in groups of ``group`` along ``axis``; min/max/scale computed in float32.

    Inputs beyond the largest finite ``scale_dtype`` value saturate there (only possible with float16
    scales on a float32 model), so nothing becomes inf or NaN.
    """
    levels = (1 << bits) - 1
    x32 = x.float().contiguous()
    if scale_dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        x32 = x32.clamp(-limit, limit)
    g, dim = _grouped(x32, group, axis)
    lo, hi = _min_max(g, dim, valid)
    zero = _round(lo, scale_dtype, up=False)
    step = ((hi - zero.float()) / levels).clamp(min=torch.finfo(scale_dtype).tiny)  # constant groups
    scale = _round(step, scale_dtype, up=True)
    codes = ((g - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return QuantizedTensor(pack(codes.reshape(x.shape), bits), scale.squeeze(dim), zero.squeeze(dim))


def dequantize(q: QuantizedTensor, bits: int, group: int, axis: str, out: torch.Tensor) -> torch.Tensor:
    """Write the reconstruction of ``q`` into ``out`` (B, H, T, D), which may be a slice; return ``out``.

    Each bit plane is converted straight into its block of ``out``, then scaled and shifted in place:
    no unpacked code tensor, no temporary float tensor (float16 aside, see below).
    """
    # float16: zero + code * scale can pass float16's largest value, so work in float32 and saturate
    work = (
        torch.empty(out.shape, dtype=torch.float32, device=out.device) if out.dtype == torch.float16 else out
    )
    width = out.shape[-1] * bits // 8
    for k, plane in enumerate(_planes(q.codes, bits)):
        work[..., k * width : (k + 1) * width].copy_(plane)
    target, dim = _grouped(work, group, axis)
    target.mul_(q.scale.unsqueeze(dim).to(work.dtype)).add_(q.zero.unsqueeze(dim).to(work.dtype))
    if work is not out:
        limit = torch.finfo(torch.float16).max
        out.copy_(work.clamp_(-limit, limit))
    return out
