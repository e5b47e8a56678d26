"""Rotated quantization with a 1-bit key sketch: each token turned by a random rotation, then quantized.

Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate", arXiv 2504.19874;
the key sketch: Zandieh et al., "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization", arXiv
2406.03482.

Per layer, one random orthogonal rotation (``core.rotation``: randomized Hadamard where head_dim is a power
of two) turns every key and value; the rotated vector's coordinates are alike, so per-token groups of
``group_size`` coordinates share a min/max scale and zero (``quantizer``, ``bits`` per packed code) with
little loss to an outlier channel. With ``sketch``, a key also keeps the signs of ``S r`` for its
quantization residual ``r`` (``sketch_dim`` bits, ``S`` Gaussian) and ``|r|``: the key a dense read gives is
the codes' reconstruction plus the sketch's unbiased estimate of ``r``, and attention from the codes adds the
same estimate's logit (``core.rotation.sketch_logits``), so the two reads agree.

The newest ``recent`` tokens stay exact; every older one is encoded alone (its codes depend on it only), so
eviction gathers codes as they are and a decode step's one eviction fills its hole in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcompress.core import rotation as rot
from kvcompress.core.fields import Bool, Choice, Int
from kvcompress.core.plan import Rotated
from kvcompress.core.spec import ModelSpec, Shape
from kvcompress.core.storage import Storage
from kvcompress.storage.quant import quantizer
from kvcompress.storage.quant.kivi import SCALE_DTYPES, scale_bytes
from kvcompress.storage.quant.quantizer import BITS, QuantizedTensor
from kvcompress.storage.residual import KINDS, ResidualStore

BACKENDS = ("auto", "dense", "cpu", "torch")


class SketchedKeys(NamedTuple):
    """A rotated key's codes (B, H_kv, T, D * bits / 8), scales and zeros (B, H_kv, T, D / G), and its
    residual's sketch (B, H_kv, T, m / 8) uint8 with the residual's norm (B, H_kv, T, 1)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    signs: torch.Tensor
    norm: torch.Tensor


class TurboStore(ResidualStore):
    """Rotated per-token codes then the residual window (B, H_kv, R, D); the rotation (and the sketch's
    projection) are this layer's constants, counted in ``fixed_tensors``."""

    encodes_per_token = True
    compact = True

    def __init__(self, config, layer_idx, spec, kinds=KINDS):
        super().__init__(config, layer_idx, spec, kinds)
        d = spec.head_dim
        self.group = config.group_of(d)
        self.rotation = rot.random_rotation(d, config.seed * 7919 + layer_idx)
        m = config.sketch_of(d) if "keys" in kinds else 0
        self.projection = rot.projection(m, d, config.seed * 7919 + layer_idx + 1) if m else None
        self.scale_dtype = None

    def _on_device(self, device) -> None:
        if self.rotation.tensors()[0].device != device:
            self.rotation = self.rotation.to(device)
            self.projection = None if self.projection is None else self.projection.to(device)

    def append(self, keys, values, positions=None) -> None:
        if self.scale_dtype is None:
            chosen = SCALE_DTYPES[self.config.scale_dtype]
            self.scale_dtype = chosen or (torch.float16 if keys.dtype == torch.float32 else keys.dtype)
            self._on_device(keys.device)
        super().append(keys, values, positions)

    def encode(self, kind, x, valid=None, positions=None):
        """``x`` (B, H_kv, n, D) rotated, then per-token groups quantized; keys with the residual's sketch."""
        turned = self.rotation.forward(x)  # (B, H_kv, n, D) float32
        q = quantizer.quantize(turned, self.config.bits, self.group, "token", self.scale_dtype)
        if kind == "values" or self.projection is None:
            return q
        back = quantizer.dequantize(q, self.config.bits, self.group, "token", torch.empty_like(turned))
        signs, norm = rot.sketch(turned - back, self.projection)
        return SketchedKeys(*q, signs, norm.to(self.scale_dtype))

    def decode(self, kind, parts, out, positions=None):
        """The codes' reconstruction (plus the sketch's estimate of a key's residual), turned back into
        ``out``."""
        turned = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        quantizer.dequantize(QuantizedTensor(*parts[:3]), self.config.bits, self.group, "token", turned)
        if len(parts) > 3:
            turned += rot.estimate(parts[3], parts[4], self.projection)
        return out.copy_(self.rotation.inverse(turned))

    def flush_count(self, residual: int) -> int:
        return residual - self.config.recent

    def attends_codes(self) -> bool:
        return self.config.backend != "dense" and self.encoded_length > 0 and len(self.kinds) == 2

    def compact_read(self) -> Rotated:
        c, enc, res = self.config, self.encoded, self.residual
        parts = (enc["keys"], enc["values"], res["keys"], res["values"])
        turn = {"rotation": self.rotation, "projection": self.projection}
        return Rotated(*parts, c.bits, self.group, c.backend, **turn)

    def fixed_tensors(self):
        return [*self.rotation.tensors(), *([] if self.projection is None else [self.projection])]

    def stats(self) -> dict:
        return {**super().stats(), "bits": self.config.bits, "quantized_tokens": self.encoded_length}


@dataclass
class TurboStorage(Storage):
    """Keys and values turned by a random rotation, then ``bits``-bit codes per group of ``group_size``
    rotated coordinates (a 16-bit scale and zero each); keys optionally with a 1-bit sketch of what the codes
    missed.

    Args:
        bits: bits per code, packed two (4) or four (2) codes a byte, or one (8).
        group_size: rotated coordinates per (scale, zero) pair; null: head_dim (one pair per vector, as
            TurboQuant keeps one norm per vector). Must divide head_dim.
        recent: newest tokens kept in the model's dtype.
        sketch: keep each key's quantization residual as ``sketch_dim`` sign bits and its norm (QJL), added
            to the key as an unbiased estimate. Unbiased is not closer: a logit's error becomes the
            estimate's variance, about ``pi / 2 / sketch_dim`` of ``|q|^2 |r|^2`` against ``1 / head_dim``
            without it, so a sketch narrower than ``pi / 2 * head_dim`` adds error (docs/policies.md).
        sketch_dim: sign bits per key (a multiple of 8); null: 2 * head_dim (the smallest even multiple of
            head_dim at which the sketch lowers the logits' error).
        seed: seeds each layer's rotation and projection (``seed * 7919 + layer``).
        scale_dtype: scales, zeros and norms: ``auto`` (the model dtype if 16-bit, else float16),
            ``float16``, ``bfloat16``, ``float32``.
        backend: which attention backend reads the codes at decode: ``auto`` (on a CPU the C++ kernel where it
            builds, elsewhere the torch form), ``cpu``, ``torch``, or ``dense`` (a rotated-back copy for the
            model's own attention). A named backend that cannot read a step refuses it by name.
    """

    name = "turboquant"
    store_class = TurboStore
    FORMULA = True
    TEST_PARAMS = [
        {"bits": 4, "recent": 8, "sketch": True},
        {"bits": 2, "group_size": 4, "recent": 4, "sketch": False},
    ]
    FUZZ = {"bits": [2, 4, 8], "group_size": [None, 2, 4, 8], "recent": (0, 20), "sketch": [True, False]}

    bits: int = Choice(4, BITS)
    group_size: int | None = Int(None, low=1, null=True)
    recent: int = Int(128, low=0)
    sketch: bool = Bool(False)
    sketch_dim: int | None = Int(None, low=8, null=True)
    seed: int = Int(0)
    scale_dtype: str = Choice("auto", tuple(SCALE_DTYPES))
    backend: str = Choice("auto", BACKENDS)

    def group_of(self, head_dim: int) -> int:
        return head_dim if self.group_size is None else self.group_size

    def sketch_of(self, head_dim: int) -> int:
        """Sign bits per key (0 without a sketch)."""
        return 0 if not self.sketch else (2 * head_dim if self.sketch_dim is None else self.sketch_dim)

    def check(self, spec: ModelSpec) -> None:
        d, g = spec.head_dim, self.group_of(spec.head_dim)
        if d % g:
            allowed = [n for n in range(1, d + 1) if d % n == 0]
            raise ValueError(
                f"turboquant.group_size={g} must divide head_dim={d}; allowed: {allowed} or null"
            )
        if d % (8 // self.bits):
            raise ValueError(f"turboquant.bits={self.bits}: head_dim={d} cannot be packed into bytes")
        if self.sketch_of(d) % 8:
            raise ValueError(f"turboquant.sketch_dim={self.sketch_dim} must be a multiple of 8 (packed bits)")

    def covering(self, n_tokens: int) -> TurboStorage:
        return dataclasses.replace(self, recent=max(self.recent, n_tokens))

    def token_bytes(self, s: Shape, kind: str) -> int:
        """One encoded token's bytes per row and KV head: codes, a (scale, zero) per group, and for a key
        with the sketch its sign bytes and norm."""
        d, meta = s.head_dim, scale_bytes(self.scale_dtype, s.dtype_bytes)
        own = d * self.bits // 8 + 2 * (d // self.group_of(d)) * meta
        return own + (self.sketch_of(d) // 8 + meta if kind == "keys" and self.sketch else 0)

    def bytes_for(self, s: Shape, tokens: int) -> int:
        """``Q = max(0, T - R)`` encoded tokens at ``token_bytes`` each per kind, the rest ``kv(T - Q)``."""
        quantized = max(0, tokens - self.recent)
        encoded = sum(s.per_token(self.token_bytes(s, kind), quantized) for kind in KINDS)
        return encoded + s.kv(tokens - quantized)

    def kind_bytes(self, s: Shape, tokens: int, kind: str) -> int:
        quantized = max(0, tokens - self.recent)
        return s.per_token(self.token_bytes(s, kind), quantized) + s.kv(tokens - quantized) // 2

    def fixed_bytes(self, s: Shape, layer_idx: int) -> int:
        """The rotation (D signs, or a D x D matrix) and the sketch's projection (m x D), float32."""
        d = s.head_dim
        turn = d if rot.is_power_of_two(d) else d * d
        return 4 * (turn + self.sketch_of(d) * d)

    @property
    def count_exact(self) -> bool:
        return False  # eviction inside the residual window changes how many tokens are encoded
