"""Low-rank storage: keys and values as coefficients in a calibrated per-head basis, newest tokens exact.

After Palu (Chang et al., "Palu: Compressing KV-Cache with Low-Rank Projection", arXiv 2407.21118), which
caches a low-rank latent and reconstructs on read; the basis is the PCA (second-moment eigenbasis) of
post-RoPE keys and of values collected on calibration text (``kvcompress.calibration``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.fields import Bool, Float, Int
from kvcompress.spec import ModelSpec, Shape
from kvcompress.storage.base import Storage
from kvcompress.storage.buffers import storage_bytes
from kvcompress.storage.residual import ResidualStore


class LowRankStore(ResidualStore):
    """Coefficients (B, H_kv, T_c, r) of older tokens (int8 codes plus a scale (B, H_kv, T_c, 1) if asked),
    the exact residual window, and the layer's bases ``key_basis``/``value_basis`` (H_kv, D, r)."""

    def __init__(self, config, layer_idx, spec, key_basis, value_basis):
        super().__init__(config, layer_idx, spec)
        own = torch.contiguous_format  # a copy with its own storage, not a view of the whole calibration
        self.basis = {
            "keys": key_basis.clone(memory_format=own),
            "values": value_basis.clone(memory_format=own),
        }

    def append(self, keys, values) -> None:
        if self.basis["keys"].dtype != keys.dtype or self.basis["keys"].device != keys.device:
            self.basis = {k: b.to(keys.device, keys.dtype) for k, b in self.basis.items()}
        super().append(keys, values)

    def encode(self, kind, x, valid=None):
        coef = x @ self.basis[kind]  # (B, H_kv, n, r)
        if not self.config.int8_coefficients:
            return (coef,)
        scale = coef.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(coef.dtype).tiny) / 127
        return torch.round(coef / scale).to(torch.int8), scale

    def decode(self, kind, parts, out):
        coef = parts[0] if len(parts) == 1 else parts[0].to(parts[1].dtype) * parts[1]
        return out.copy_(coef @ self.basis[kind].mT)

    def flush_count(self, residual: int) -> int:
        return residual - self.config.residual_length

    def fixed_tensors(self):
        return [self.basis["keys"], self.basis["values"]]

    # -- readable names (tests, stats) ------------------------------------------------------
    def _part(self, kind: str, i: int):
        parts = self.encoded[kind]
        return None if parts is None or len(parts) <= i else parts[i]

    key_coef = property(lambda self: self._part("keys", 0))
    value_coef = property(lambda self: self._part("values", 0))
    key_scale = property(lambda self: self._part("keys", 1))
    value_scale = property(lambda self: self._part("values", 1))
    key_basis = property(lambda self: self.basis["keys"])
    value_basis = property(lambda self: self.basis["values"])
    keys = property(lambda self: self.residual["keys"])
    values = property(lambda self: self.residual["values"])

    def stats(self) -> dict:
        cal = self.config.calibration
        return {
            **super().stats(),
            "key_rank": self.basis["keys"].shape[-1],
            "value_rank": self.basis["values"].shape[-1],
            "tokens_projected": self.encoded_length,
            "basis_bytes": storage_bytes(self.fixed_tensors()),
            "calibration_source": cal["source"],
            "calibration_s": cal.get("seconds"),
        }


@dataclass
class LowRankStorage(Storage):
    """Cache rank-``rank`` coefficients of keys and values; the newest ``residual_length`` tokens stay exact.

    Args:
        rank: basis vectors kept per KV head for keys and values (at most head_dim); or null with ``energy``.
        value_rank: the values' rank when it differs from ``rank`` (null: ``rank``).
        energy: instead of ``rank``, keep per layer the fewest components that hold this share of the
            calibration energy in every KV head (keys and values chosen separately).
        residual_length: newest tokens kept exactly, in the model dtype.
        int8_coefficients: store coefficients as int8 codes with one scale (model dtype) per token and head.
        calibration_text: ``pg_essays`` (its last ``calibration_tokens`` tokens), a ``.txt``/``.jsonl``
            path, a `datasets` spec, or ``random``.
        calibration_tokens: tokens of calibration text.
        calibration_dir: where calibrations are saved (default: ``<kvcompress cache>/calibration``).
    """

    name = "low_rank"
    FORMULA = True  # bytes_for below is this class's own
    TEST_PARAMS = [{"rank": 4, "residual_length": 4, "calibration_text": "random", "calibration_tokens": 64}]
    FUZZ = {
        "rank": (1, 16),
        "residual_length": (0, 12),
        "calibration_text": "random",
        "calibration_tokens": 64,
    }

    rank: int | None = Int(None, low=1, null=True)  # null with energy null: 32
    value_rank: int | None = Int(None, low=1, null=True)
    energy: float | None = Float(None, 0, 1, low_open=True, null=True)
    residual_length: int = Int(0, low=0)
    int8_coefficients: bool = Bool(False)
    calibration_text: str = "pg_essays"
    calibration_tokens: int = Int(2048, low=1)
    calibration_dir: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.rank is not None and self.energy is not None:
            raise ValueError(
                f"low_rank: set exactly one of rank={self.rank} and energy={self.energy} (the other null)"
            )
        if self.rank is None and self.energy is None:
            self.rank = 32
        if self.value_rank is not None and self.rank is None:
            raise ValueError(f"low_rank.value_rank={self.value_rank} needs rank (not energy)")
        self._calibration: dict | None = None

    def check(self, spec: ModelSpec) -> None:
        for field in ("rank", "value_rank"):
            if (getattr(self, field) or 0) > spec.head_dim:
                raise ValueError(
                    f"low_rank.{field}={getattr(self, field)} must be in [1, head_dim={spec.head_dim}]"
                )

    def prepare(self, model) -> None:
        """Calibrate on ``model`` (or reload a saved calibration of the same model and data)."""
        from kvcompress.calibration import calibrate

        self._calibration = calibrate(
            model, self.calibration_text, self.calibration_tokens, self.calibration_dir
        )

    @property
    def calibration(self) -> dict:
        if self._calibration is None:
            raise RuntimeError("low_rank is not calibrated: build it with build_cache(policy, model)")
        return self._calibration

    def covering(self, n_tokens: int) -> LowRankStorage:
        out = dataclasses.replace(self, residual_length=max(self.residual_length, n_tokens))
        out._calibration = self._calibration
        return out

    def ranks(self, layer_idx: int) -> tuple[int, int]:
        """(key rank, value rank) of a layer: ``rank``, or the fewest components reaching ``energy``."""
        if self.rank is not None:
            return self.rank, self.value_rank or self.rank
        from kvcompress.calibration import rank_for_energy

        cal = self.calibration
        return tuple(rank_for_energy(cal[f"{k}_energy"][layer_idx], self.energy) for k in ("key", "value"))

    def layer(self, layer_idx: int, spec: ModelSpec) -> LowRankStore:
        rk, rv = self.ranks(layer_idx)
        kb = self.calibration["key_basis"][layer_idx, :, :, :rk]  # (H_kv, D, rk)
        vb = self.calibration["value_basis"][layer_idx, :, :, :rv]
        return LowRankStore(self, layer_idx, spec, kb, vb)

    def bytes_for(self, s: Shape, tokens: int) -> int | None:
        """The newest ``min(T, R)`` tokens exact, the others as key/value coefficients (r_k + r_v per token
        and head) in the model dtype, or int8 codes plus one model-dtype scale per token, head and tensor."""
        if self.rank is None:
            return None  # ranks come from calibration data, not from the parameters
        ranks = self.rank + (self.value_rank or self.rank)
        exact = min(tokens, self.residual_length)
        rows = s.batch * s.kv_heads * (tokens - exact)
        coef = rows * ranks * (1 if self.int8_coefficients else s.dtype_bytes)
        scales = 2 * rows * s.dtype_bytes if self.int8_coefficients else 0
        return s.kv(exact) + coef + scales

    def fixed_bytes(self, s: Shape, layer_idx: int) -> int:
        """The layer's bases (H_kv, D, r_k + r_v) in the model dtype."""
        if self.rank is None:
            return 0
        return s.kv_heads * s.head_dim * (self.rank + (self.value_rank or self.rank)) * s.dtype_bytes

    @property
    def count_exact(self) -> bool:
        return self.residual_length == 0
