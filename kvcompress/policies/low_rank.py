"""Low-rank KV cache: keys and values stored as coefficients in a calibrated per-head basis.

After Palu (Chang et al., "Palu: Compressing KV-Cache with Low-Rank Projection", arXiv 2407.21118), which
caches a low-rank latent and reconstructs on read; here the basis is the PCA (second-moment eigenbasis)
of post-RoPE keys and of values collected on calibration text (``kvcompress.calibration``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer
from kvcompress.policies.low_rank_layer import LowRankLayer


@dataclass
class LowRankPolicy(Policy):
    """Cache rank-``rank`` coefficients of keys and values; the newest ``residual_length`` tokens stay exact.

    Args:
        rank: basis vectors kept per KV head for keys and for values (at most ``head_dim``); or null with
            ``energy``. Per-layer ranks: a ``SchedulePolicy`` with one ``LowRankPolicy`` per layer group.
        value_rank: the values' rank when it differs from ``rank`` (null: ``rank``).
        energy: instead of ``rank``, keep per layer the fewest components that hold this share of the
            calibration energy in every KV head (keys and values chosen separately).
        residual_length: newest tokens kept exactly, in the model dtype.
        int8_coefficients: store coefficients as int8 codes with one scale (model dtype) per token and head.
        calibration_text: ``pg_essays`` (its last ``calibration_tokens`` tokens, disjoint from evaluation
            text read from the start), a ``.txt``/``.jsonl`` path, a `datasets` spec, or ``random``.
        calibration_tokens: tokens of calibration text.
        calibration_dir: where calibrations are saved (default: ``<kvcompress cache>/calibration``).
    """

    rank: int | None = None  # None with energy None: 32
    value_rank: int | None = None
    energy: float | None = None
    residual_length: int = 0
    int8_coefficients: bool = False
    calibration_text: str = "pg_essays"
    calibration_tokens: int = 2048
    calibration_dir: str | None = None

    def __post_init__(self):
        if self.rank is None and self.energy is None:
            self.rank = 32
        if self.rank is not None and self.energy is not None:
            raise ValueError(
                f"low_rank: set exactly one of rank={self.rank} and energy={self.energy} (the other null)"
            )
        if self.value_rank is not None and self.rank is None:
            raise ValueError(f"low_rank.value_rank={self.value_rank} needs rank (not energy)")
        for field in ("rank", "value_rank"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise ValueError(f"low_rank.{field}={getattr(self, field)} must be >= 1 (and <= head_dim)")
        if self.energy is not None and not 0 < self.energy <= 1:
            raise ValueError(f"low_rank.energy={self.energy} must be in (0, 1]")
        if self.residual_length < 0:
            raise ValueError(f"low_rank.residual_length={self.residual_length} must be >= 0")
        if self.calibration_tokens < 1:
            raise ValueError(f"low_rank.calibration_tokens={self.calibration_tokens} must be >= 1")
        self._calibration: dict | None = None

    @property
    def name(self) -> str:
        return "low_rank"

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

    def covering(self, n_tokens: int) -> LowRankPolicy:
        return dataclasses.replace(self, residual_length=max(self.residual_length, n_tokens))

    def ranks(self, layer_idx: int) -> tuple[int, int]:
        """(key rank, value rank) of a layer: ``rank``, or the fewest components reaching ``energy``."""
        if self.rank is not None:
            return self.rank, self.value_rank or self.rank
        from kvcompress.calibration import rank_for_energy

        cal = self.calibration
        return tuple(
            rank_for_energy(cal[f"{kind}_energy"][layer_idx], self.energy) for kind in ("key", "value")
        )

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        rk, rv = self.ranks(layer_idx)
        kb = self.calibration["key_basis"][layer_idx, :, :, :rk]  # (H_kv, D, rk)
        vb = self.calibration["value_basis"][layer_idx, :, :, :rv]
        return LowRankLayer(self, layer_idx, spec, kb, vb)
