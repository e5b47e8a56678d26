"""KIVI storage: int8/int4/int2 packed codes, keys per channel and values per token, a full-precision window.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.core.buffers import gather_tokens, storage_bytes
from kvcompress.core.fields import Choice, Int
from kvcompress.core.plan import Kivi
from kvcompress.core.spec import ModelSpec, Shape
from kvcompress.core.storage import Storage
from kvcompress.storage.quant import quantizer
from kvcompress.storage.quant.quantizer import AXES, BITS
from kvcompress.storage.residual import KINDS, ResidualStore

# backend: which attention backend reads the codes at decode (``auto``: the first that serves them; ``dense``:
# none, a dequantized copy for the model's own attention)
BACKENDS = ("auto", "dense", "cpu", "torch", "triton")
SCALE_DTYPES = {"auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class QuantStore(ResidualStore):
    """Quantized tokens (packed codes, scales, zeros) then the residual window (B, H_kv, R..R+G-1, D).
    Attention reads a dequantized copy made for the step: no float copy of a quantized token outlives it."""

    def __init__(self, config, layer_idx, spec, kinds=KINDS):
        super().__init__(config, layer_idx, spec, kinds)
        self.scale_dtype = None
        self.encodes_per_token = self.keeps_exactly  # per-token groups: a token's codes are its own
        self.layout_fits = config.codes_layout_fits(spec)  # fused_quant reads these codes (a constant)

    def axis(self, kind: str) -> str:
        return self.config.key_axis if kind == "keys" else self.config.value_axis

    def append(self, keys, values, positions=None) -> None:
        if self.scale_dtype is None:
            chosen = SCALE_DTYPES[self.config.scale_dtype]
            self.scale_dtype = chosen or (torch.float16 if keys.dtype == torch.float32 else keys.dtype)
        super().append(keys, values, positions)

    def encode(self, kind, x, valid=None, positions=None):
        c = self.config
        return quantizer.quantize(x, c.bits, c.group_size, self.axis(kind), self.scale_dtype, valid)

    def decode(self, kind, parts, out, positions=None):
        return quantizer.dequantize(parts, self.config.bits, self.config.group_size, self.axis(kind), out)

    compact = True

    def attends_codes(self) -> bool:
        """Whether a decode query can attend straight from the codes (``kvcompress.kernels.fused_quant``)."""
        c = self.config
        if c.backend == "dense" or self.encoded_length == 0:
            return False
        return len(self.kinds) == 2 and self.layout_fits

    def compact_read(self) -> Kivi:
        """The codes and the residual window, for a backend that attends from them."""
        c = self.config
        enc, res = self.encoded, self.residual
        codes = (enc["keys"], enc["values"], res["keys"], res["values"])
        return Kivi(*codes, c.bits, c.group_size, c.backend, c.key_axis)

    def flush_count(self, residual: int) -> int:
        g = self.config.group_size
        return (residual - self.config.recent) // g * g

    @property
    def keeps_exactly(self) -> bool:
        """Per-token groups are gathered as they are; a per-channel group shares its scale among
        ``group_size`` tokens, so it cannot lose one without every other being quantized again."""
        return "channel" not in (self.axis(kind) for kind in self.kinds)

    def keep(self, idx) -> None:
        te = self.encoded_length
        if te == 0 or self.keeps_exactly:
            return super().keep(idx)
        b, h = self.residual[self.kinds[0]].shape[:2]
        idx = idx.expand(b, h, -1)
        ar = torch.arange(te, device=idx.device)
        if idx.shape[-1] < te or not bool((idx[..., :te] == ar).all()):
            axes = "/".join(f"{kind[:-1]}_axis" for kind in self.kinds if self.axis(kind) == "channel")
            raise ValueError(
                f"layer {self.layer_idx}: an eviction would remove tokens from quantized groups of quant "
                f"{axes}='channel' (one scale per channel shared by group_size={self.config.group_size} "
                "tokens); quantizing the rest again would add error at every such eviction, so it is "
                "refused. A selector that evicts at prefill keeps the prompt exact until its first one-token "
                "step; this eviction came later (a multi-token forward after decode steps). Use "
                "key_axis=token and value_axis=token, or prefill every multi-token part before decoding"
            )
        for kind in self.kinds:  # every quantized token stays: only the residual window loses tokens
            self.residual[kind] = gather_tokens(self.residual[kind], idx[..., te:] - te)

    # -- readable names (tests, stats) ------------------------------------------------------
    @property
    def qkeys(self):
        return self.encoded["keys"]

    @property
    def qvalues(self):
        return self.encoded["values"]

    @property
    def keys(self):
        return self.residual["keys"]

    @property
    def values(self):
        return self.residual["values"]

    def stats(self) -> dict:
        """Quantized/residual tokens, code and scale/zero bytes, bits per quantized value."""
        quantized = [q for q in (self.qkeys, self.qvalues) if q is not None]
        code = storage_bytes(q.codes for q in quantized)
        meta = storage_bytes(t for q in quantized for t in (q.scale, q.zero))
        elements = sum(q.codes.shape[0] * q.codes.shape[1] * q.codes.shape[2] for q in quantized)
        elements *= self.spec.head_dim
        return {
            **super().stats(),
            "bits": self.config.bits,
            "quantized_tokens": self.encoded_length,
            "residual_tokens": self.residual_length,
            "code_bytes": code,
            "scale_zero_bytes": meta,
            "residual_bytes": storage_bytes([self.keys, self.values]),
            "quantized_elements": elements,
            "bits_per_quantized_element": 8 * (code + meta) / elements if elements else None,
        }


@dataclass
class QuantStorage(Storage):
    """Packed ``bits``-bit codes plus a 16-bit scale and zero point per group of ``group_size`` elements.

    The newest ``recent`` (R) tokens stay in the model dtype; older ones are quantized G at a time
    once a whole group has left that window (groups aligned to the first token), so between R and R + G - 1
    tokens are full precision. ``"channel"`` groups are G tokens of one channel (KIVI's keys), ``"token"``
    groups G channels of one token (G must divide head_dim).

    Args:
        bits: bits per code, packed one (8), two (4) or four (2) codes a byte.
        group_size: elements per (scale, zero) pair; must divide head_dim on the ``token`` axis.
        recent: newest tokens kept in the model's dtype (R..R+G-1 of them).
        key_axis: ``channel`` (KIVI's keys) or ``token``; eviction at every decode step (h2o, tova,
            sliding_window...) needs ``token``.
        value_axis: ``token`` (KIVI's values) or ``channel``.
        scale_dtype: ``auto`` (the model dtype if 16-bit, else float16), ``float16``, ``bfloat16``,
            ``float32``.
        backend: which attention backend reads the codes at decode, with no dequantized copy
            (``kvcompress.kernels.backends``; ``value_axis=token``, keys per channel as KIVI or per token:
            those, on a CPU, with the probabilities score-based eviction reads).
            ``auto``: the first that serves them (on a GPU ``triton``, else ``torch``; on a CPU ``cpu``
            where the C++ kernel builds, else the dense read: the tensor forms measured slower there,
            experiments/fused). ``cpu``: the C++ kernel (CPU); ``torch``: the tensor form
            (``kvcompress.kernels.fused_quant``, compiled from ``COMPILE_MIN_TOKENS`` quantized tokens, else
            eager); ``triton``: the Triton kernel (CUDA). A named backend that cannot read a step's codes
            refuses it by name. ``dense``: dequantize a copy for the model's own attention.
    """

    name = "quant"
    store_class = QuantStore
    FORMULA = True  # bytes_for below is this class's own
    TEST_PARAMS = [
        {"bits": 4, "group_size": 4, "recent": 8},
        {"bits": 2, "group_size": 4, "recent": 4, "key_axis": "token"},
    ]
    FUZZ = {
        "bits": [2, 4, 8],
        "group_size": [2, 4, 8, 16],
        "recent": (0, 20),
        "key_axis": list(AXES),
        "value_axis": list(AXES),
    }

    bits: int = Choice(4, BITS)
    group_size: int = Int(32, low=1)
    recent: int = Int(128, low=0)
    key_axis: str = Choice("channel", AXES)
    value_axis: str = Choice("token", AXES)
    scale_dtype: str = Choice("auto", tuple(SCALE_DTYPES))
    backend: str = Choice("auto", BACKENDS)

    def check(self, spec: ModelSpec) -> None:
        if "token" in (self.key_axis, self.value_axis) and spec.head_dim % self.group_size:
            raise ValueError(
                f"quant.group_size={self.group_size} must divide head_dim={spec.head_dim} on the 'token' "
                f"axis; allowed: {[g for g in range(1, spec.head_dim + 1) if spec.head_dim % g == 0]}"
            )
        if spec.head_dim % (8 // self.bits):
            raise ValueError(f"quant.bits={self.bits}: head_dim={spec.head_dim} cannot be packed into bytes")
        if self.backend not in ("auto", "dense") and not self.codes_layout_fits(spec):
            raise ValueError(
                f"quant.backend={self.backend!r} reads packed codes of value_axis='token' only (keys on "
                f"either axis), with a group_size that divides or is a multiple of "
                f"head_dim * bits / 8 = {spec.head_dim * self.bits // 8}; "
                "use backend='auto' or 'dense' for this layout"
            )
        if self.backend == "triton" and self.key_axis == "token":
            raise ValueError(
                "quant.backend='triton' reads KIVI's layout (key_axis='channel') only; with key_axis='token' "
                "use backend='auto', 'cpu' or 'torch'"
            )

    def codes_layout_fits(self, spec: ModelSpec) -> bool:
        """Whether ``fused_quant`` can attend from these codes: keys per channel (KIVI) or per token,
        values per token, and groups that tile a bit plane (``head_dim * bits / 8`` channels)."""
        width = spec.head_dim * self.bits // 8
        axes_fit = self.value_axis == "token"
        return axes_fit and (width % self.group_size == 0 or self.group_size % width == 0)

    def refuses(self, selector, kinds=KINDS) -> str | None:
        axes = [f"{k[:-1]}_axis" for k in kinds if getattr(self, f"{k[:-1]}_axis") == "channel"]
        if axes and selector.evicts == "always":
            return (
                f"{selector.name} evicts tokens at every decode step, but quant {'/'.join(axes)}='channel' "
                f"shares one scale per channel across group_size={self.group_size} tokens, so each eviction "
                "would re-quantize whole groups (slow, and error accumulates). Use key_axis=token and "
                "value_axis=token (per-token groups evict exactly)"
            )
        return None

    def covering(self, n_tokens: int) -> QuantStorage:
        return dataclasses.replace(self, recent=max(self.recent, n_tokens))

    def bytes_for(self, s: Shape, tokens: int) -> int:
        """``Q = max(0, floor((T - R) / G) * G)`` quantized: per tensor ``B * H_kv * Q * D`` codes at
        ``bits / 8`` bytes plus ``1 / G`` as many (scale, zero) pairs; the rest ``kv(T - Q)``."""
        quantized = max(0, (tokens - self.recent) // self.group_size * self.group_size)
        elements = s.batch * s.kv_heads * quantized * s.head_dim
        groups = elements // self.group_size
        meta = 2 * groups * scale_bytes(self.scale_dtype, s.dtype_bytes)
        return 2 * (elements * self.bits // 8 + meta) + s.kv(tokens - quantized)

    @property
    def count_exact(self) -> bool:
        return False  # eviction inside the residual window changes how many tokens are quantized


def scale_bytes(scale_dtype: str, dtype_bytes: int) -> int:
    """``auto``: the model dtype for 16-bit models, float16 for float32 ones."""
    if scale_dtype == "auto":
        return 2 if dtype_bytes == 4 else dtype_bytes
    return 4 if scale_dtype == "float32" else 2
