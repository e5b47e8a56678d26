"""Formulas of policies whose kept tokens follow from the token count alone (see the package docstring)."""

from __future__ import annotations

import math

from kvcompress.memory_model.core import Shape, formula
from kvcompress.policies import BlockSparsePolicy, FullPolicy, LowRankPolicy, QuantPolicy, SlidingWindowPolicy


@formula(FullPolicy)
def _full(p: FullPolicy, s: Shape) -> int:
    """Every token: ``kv(T)``."""
    return s.kv(s.total)


@formula(SlidingWindowPolicy)
def _sliding_window(p: SlidingWindowPolicy, s: Shape) -> int:
    """Sinks plus window (StreamingLLM): ``kv(min(T, sink_tokens + window))``."""
    return s.kv(min(s.total, p.sink_tokens + p.window))


@formula(BlockSparsePolicy)
def _block_sparse(p: BlockSparsePolicy, s: Shape) -> int:
    """Quest keeps every token plus per-page key min and max (B, H_kv, P, D) x 2 in the model dtype,
    ``P = ceil(T / block_size)``: ``kv(T) + kv(P)``."""
    return s.kv(s.total) + s.kv(math.ceil(s.total / p.block_size))


@formula(QuantPolicy)
def _quant(p: QuantPolicy, s: Shape) -> int:
    """KIVI: after T tokens ``Q = max(0, floor((T - R) / G) * G)`` are quantized (groups leave the residual
    window whole), ``T - Q`` stay in the model dtype. Per tensor (K and V): ``B * H_kv * Q * D`` codes at
    ``bits / 8`` bytes, and ``1 / G`` as many groups, each one scale and one zero point in the scale dtype
    (on either axis: G tokens of a channel or G channels of a token). Total: ``2 * (codes + 2 * groups *
    scale_bytes) + kv(T - Q)``."""
    quantized = max(0, (s.total - p.residual_length) // p.group_size * p.group_size)
    elements = s.batch * s.kv_heads * quantized * s.head_dim
    groups = elements // p.group_size
    return 2 * (elements * p.bits // 8 + 2 * groups * _scale_bytes(p.scale_dtype, s.dtype_bytes)) + s.kv(
        s.total - quantized
    )


def _scale_bytes(scale_dtype: str, dtype_bytes: int) -> int:
    """``auto``: the model dtype for 16-bit models, float16 for float32 ones (``QuantLayer``)."""
    if scale_dtype == "auto":
        return 2 if dtype_bytes == 4 else dtype_bytes
    return 4 if scale_dtype == "float32" else 2


@formula(LowRankPolicy)
def _low_rank(p: LowRankPolicy, s: Shape) -> int | None:
    """Palu-style: the newest ``min(T, residual_length)`` tokens exact; the others as key/value coefficients
    (B, H_kv, T_c, r_k + r_v) in the model dtype, or int8 codes plus one model-dtype scale per token, head
    and tensor; plus the layer's bases (H_kv, D, r_k + r_v). None with ``energy`` (ranks from calibration)."""
    if p.rank is None:
        return None
    ranks = p.rank + (p.value_rank or p.rank)
    exact = min(s.total, p.residual_length)
    rows = s.batch * s.kv_heads * (s.total - exact)
    coef = rows * ranks * (1 if p.int8_coefficients else s.dtype_bytes)
    scales = 2 * rows * s.dtype_bytes if p.int8_coefficients else 0
    bases = s.kv_heads * s.head_dim * ranks * s.dtype_bytes
    return s.kv(exact) + coef + scales + bases
