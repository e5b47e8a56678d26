"""An example storage defined in one file (plus ``conf/storage/fp8.yaml`` beside it): every generic test
(contract, selector x storage product, fuzz, memory model, bad inputs) picks it up with no other change.

FP8 keys and values: each token's vector of one KV head is scaled by its absolute maximum into the E4M3
range and stored as one byte per element, with one float16 scale per token; the newest ``recent``
tokens stay in the model's dtype. The FP8 format: Micikevicius et al., "FP8 Formats for Deep Learning",
arXiv 2209.05433. A per-token codec, so eviction keeps the codes as they are (never re-encoded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.core.fields import Int
from kvcompress.core.spec import Shape
from kvcompress.core.storage import Storage
from kvcompress.storage.residual import ResidualStore

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


class Fp8Store(ResidualStore):
    """Encoded tokens as (codes (B, H_kv, T, D) float8_e4m3fn bytes, scales (B, H_kv, T, 1) float16), then the
    residual window (B, H_kv, R, D) in the model's dtype."""

    def encode(self, kind, x, valid=None, positions=None) -> tuple:
        scale = (x.float().abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(1e-8).to(torch.float16)
        codes = (x.float() / scale.float()).to(torch.float8_e4m3fn)
        return codes.view(torch.uint8), scale  # bytes: gathers need no float8 kernels; scale (B, H_kv, n, 1)

    def decode(self, kind, parts, out, positions=None) -> torch.Tensor:
        codes, scale = parts
        out.copy_(codes.view(torch.float8_e4m3fn).float() * scale.float())
        return out

    def flush_count(self, residual: int) -> int:
        return residual - self.config.recent


@dataclass
class Fp8Storage(Storage):
    """One byte per element plus a float16 scale per token and KV head; ``recent`` newest exact."""

    name = "fp8"
    store_class = Fp8Store
    FORMULA = True  # bytes_for below is this class's own
    TEST_PARAMS = [{"recent": 4}]
    FUZZ = {"recent": (0, 20)}

    recent: int = Int(32, low=0)

    def covering(self, n_tokens: int) -> Fp8Storage:
        return dataclasses.replace(self, recent=max(self.recent, n_tokens))

    def bytes_for(self, s: Shape, tokens: int) -> int:
        """``E = max(0, T - R)`` encoded tokens: ``B * H_kv * E * (D + 2)`` bytes per tensor, the rest
        ``kv(T - E)``."""
        encoded = max(0, tokens - self.recent)
        return 2 * s.batch * s.kv_heads * encoded * (s.head_dim + 2) + s.kv(tokens - encoded)
