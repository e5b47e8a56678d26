"""KIVI: an int8/int4/int2 KV cache, keys per channel, values per token, recent tokens in full precision.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.policies import quantizer
from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer, _cat_valid, storage_bytes
from kvcompress.policies.quantizer import AXES, BITS

SCALE_DTYPES = {"auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class QuantPolicy(Policy):
    """Store keys/values as packed ``bits``-bit codes plus a 16-bit scale and zero point per group.

    ``residual_length`` (R) and ``group_size`` (G): the newest R tokens always stay in full precision;
    older tokens are quantized G at a time, as soon as a whole group has left that window. So between R
    and R + G - 1 tokens are full precision (with R = 0 up to G - 1: a per-channel key group needs G
    tokens), after T tokens exactly ``floor((T - R) / G) * G`` are quantized, in groups aligned to the
    first token, and R need not be a multiple of G. On the ``"channel"`` axis a group is G tokens of one
    channel; on the ``"token"`` axis it is G channels of one token (G must divide head_dim), and tokens
    still leave the window G at a time, so keys and values share one boundary.

    Args:
        bits: 8, 4 or 2 (codes packed one, two or four a byte).
        group_size: G, elements sharing one (scale, zero) pair.
        residual_length: R, newest tokens kept in the model's dtype.
        key_axis, value_axis: ``"channel"`` or ``"token"`` (KIVI: keys per channel, values per token).
        scale_dtype: storage of scales and zero points; ``"auto"`` is the model's dtype for 16-bit models
            and float16 for float32 ones (float32 scales would cost 2 bits per element at G = 32).
    """

    bits: int = 4
    group_size: int = 32
    residual_length: int = 128
    key_axis: str = "channel"
    value_axis: str = "token"
    scale_dtype: str = "auto"

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"quant.bits={self.bits!r} is not supported; allowed: {list(BITS)}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"quant.group_size={self.group_size!r} must be an integer >= 1")
        if not isinstance(self.residual_length, int) or self.residual_length < 0:
            raise ValueError(f"quant.residual_length={self.residual_length!r} must be an integer >= 0")
        for field in ("key_axis", "value_axis"):
            if getattr(self, field) not in AXES:
                raise ValueError(f"quant.{field}={getattr(self, field)!r} is not one of {list(AXES)}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"quant.scale_dtype={self.scale_dtype!r} is not one of {list(SCALE_DTYPES)}")

    def check(self, spec: ModelSpec) -> None:
        uses_token_axis = "token" in (self.key_axis, self.value_axis)
        if uses_token_axis and spec.head_dim % self.group_size:
            raise ValueError(
                f"quant.group_size={self.group_size} must divide head_dim={spec.head_dim} on the 'token' "
                f"axis; allowed: {[g for g in range(1, spec.head_dim + 1) if spec.head_dim % g == 0]}"
            )
        if spec.head_dim % (8 // self.bits):
            raise ValueError(f"quant.bits={self.bits}: head_dim={spec.head_dim} cannot be packed into bytes")

    def covering(self, n_tokens: int) -> QuantPolicy:
        return dataclasses.replace(self, residual_length=max(self.residual_length, n_tokens))

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        return QuantLayer(self, layer_idx, spec)


class QuantLayer(PolicyLayer):
    """Quantized tokens ``qkeys``/``qvalues`` (packed codes, scales, zeros) followed by the full-precision
    residual window ``keys``/``values`` (B, H_kv, R..R+G-1, D). Attention reads a dequantized copy made
    for the step and dropped after it: no float copy of a quantized token outlives the step."""

    def __init__(self, policy: QuantPolicy, layer_idx: int, spec: ModelSpec):
        super().__init__(policy, layer_idx, spec)
        self.qkeys: quantizer.QuantizedTensor | None = None
        self.qvalues: quantizer.QuantizedTensor | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        chosen = SCALE_DTYPES[self.policy.scale_dtype]
        self.scale_dtype = chosen or (torch.float16 if self.dtype == torch.float32 else self.dtype)

    def quantized_length(self) -> int:
        return 0 if self.qkeys is None else self.qkeys.codes.shape[2]

    def stored_length(self) -> int:
        return self.quantized_length() + (0 if self.keys is None else self.keys.shape[-2])

    def append(self, key_states, value_states, new_valid):
        """Add the new tokens to the residual window; return dequantized + residual (B, H_kv, T, D)."""
        b, _, q, _ = key_states.shape
        self.valid = _cat_valid(self.valid, new_valid, self.stored_length(), b, q, key_states.device)
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        keys = self._read(self.qkeys, self.keys, self.policy.key_axis)
        return keys, self._read(self.qvalues, self.values, self.policy.value_axis), self.valid

    def _read(self, packed, residual: torch.Tensor, axis: str) -> torch.Tensor:
        if packed is None:
            return residual
        b, h, tr, d = residual.shape
        tq = packed.codes.shape[2]
        out = torch.empty(b, h, tq + tr, d, dtype=residual.dtype, device=residual.device)
        quantizer.dequantize(packed, self.policy.bits, self.policy.group_size, axis, out[:, :, :tq])
        out[:, :, tq:] = residual
        return out

    def compress(self) -> None:
        """Quantize whole groups that left the residual window; keep the rest (a copy, freeing the old)."""
        p = self.policy
        n = (self.keys.shape[-2] - p.residual_length) // p.group_size * p.group_size
        if n <= 0:
            return
        tq = self.quantized_length()
        valid = None if self.valid is None else self.valid[..., tq : tq + n]
        qk = quantizer.quantize(
            self.keys[:, :, :n], p.bits, p.group_size, p.key_axis, self.scale_dtype, valid
        )
        qv = quantizer.quantize(
            self.values[:, :, :n], p.bits, p.group_size, p.value_axis, self.scale_dtype, valid
        )
        self.qkeys, self.qvalues = quantizer.concat(self.qkeys, qk), quantizer.concat(self.qvalues, qv)
        self.keys, self.values = self.keys[:, :, n:].clone(), self.values[:, :, n:].clone()

    def keep(self, idx: torch.Tensor) -> None:
        raise NotImplementedError("quant stores every token; it does not evict")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.qkeys is not None:
            self.qkeys = quantizer.select(self.qkeys, beam_idx)
            self.qvalues = quantizer.select(self.qvalues, beam_idx)

    def reset(self) -> None:
        super().reset()
        self.qkeys = self.qvalues = None

    def tensors(self) -> list[torch.Tensor]:
        packed = [t for q in (self.qkeys, self.qvalues) if q is not None for t in q]
        return [*packed, self.keys, self.values, self.valid]

    def stats(self) -> dict:
        """Base counters + quantized/residual tokens, code and scale/zero bytes, bits per quantized value."""
        quantized = [q for q in (self.qkeys, self.qvalues) if q is not None]
        code = storage_bytes(q.codes for q in quantized)
        meta = storage_bytes(t for q in quantized for t in (q.scale, q.zero))
        elements = sum(q.codes.shape[0] * q.codes.shape[1] * q.codes.shape[2] for q in quantized)
        elements *= self.spec.head_dim
        return {
            **super().stats(),
            "bits": self.policy.bits,
            "quantized_tokens": self.quantized_length(),
            "residual_tokens": self.stored_length() - self.quantized_length(),
            "code_bytes": code,
            "scale_zero_bytes": meta,
            "residual_bytes": storage_bytes([self.keys, self.values]),
            "quantized_elements": elements,
            "bits_per_quantized_element": 8 * (code + meta) / elements if elements else None,
        }
