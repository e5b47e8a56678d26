"""Low-rank KV cache: keys and values stored as coefficients in a calibrated per-head basis.

After Palu (Chang et al., "Palu: Compressing KV-Cache with Low-Rank Projection", arXiv 2407.21118), which
caches a low-rank latent and reconstructs on read; here the basis is the PCA (second-moment eigenbasis)
of post-RoPE keys and of values collected on calibration text (``kvcompress.calibration``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer


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
        calibration_text: ``pg_essays`` (its last ``calibration_tokens`` tokens, disjoint from evaluation
            text read from the start), a ``.txt``/``.jsonl`` path, a `datasets` spec, or ``random``.
        calibration_tokens: tokens of calibration text.
        calibration_dir: where calibrations are saved (default: ``<kvcompress cache>/calibration``).
    """

    rank: int | None = None  # None with energy None: 32
    value_rank: int | None = None
    energy: float | None = None
    residual_length: int = 0
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
        return tuple(
            _rank_for_energy(self.calibration[f"{kind}_energy"][layer_idx], self.energy)
            for kind in ("key", "value")
        )

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        rk, rv = self.ranks(layer_idx)
        kb = self.calibration["key_basis"][layer_idx, :, :, :rk]  # (H_kv, D, rk)
        vb = self.calibration["value_basis"][layer_idx, :, :, :rv]
        return LowRankLayer(self, layer_idx, spec, kb, vb)


def _rank_for_energy(eigenvalues: torch.Tensor, energy: float) -> int:
    """Smallest r whose leading eigenvalues (H_kv, D) hold ``energy`` of the total in every head."""
    share = eigenvalues.cumsum(-1) / eigenvalues.sum(-1, keepdim=True).clamp(min=1e-30)
    per_head = (share < energy - 1e-6).sum(-1) + 1  # tolerance: energy=1.0 must reach head_dim exactly
    return int(per_head.clamp(max=eigenvalues.shape[-1]).max())


class LowRankLayer(PolicyLayer):
    """Coefficients ``key_coef``/``value_coef`` (B, H_kv, T_c, r) of older tokens; exact residual tokens in
    ``keys``/``values`` (B, H_kv, R, D); the layer's bases (H_kv, D, r), counted once per layer."""

    def __init__(self, policy: LowRankPolicy, layer_idx: int, spec: ModelSpec, key_basis, value_basis):
        super().__init__(policy, layer_idx, spec)
        own = torch.contiguous_format  # a copy with its own storage, not a view of the whole calibration
        self.key_basis, self.value_basis = (
            key_basis.clone(memory_format=own),
            value_basis.clone(memory_format=own),
        )
        self.key_coef = self.value_coef = None

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_basis = self.key_basis.to(self.device, self.dtype)
        self.value_basis = self.value_basis.to(self.device, self.dtype)

    def reset(self) -> None:
        super().reset()
        self.key_coef = self.value_coef = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.key_coef is not None:
            self.key_coef = self.key_coef.index_select(0, beam_idx.to(self.device))
            self.value_coef = self.value_coef.index_select(0, beam_idx.to(self.device))

    def projected_length(self) -> int:
        return 0 if self.key_coef is None else self.key_coef.shape[-2]

    def stored_length(self) -> int:
        return self.projected_length() + super().stored_length()

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [self.key_coef, self.value_coef, self.key_basis, self.value_basis]

    def append(self, key_states, value_states, new_valid):
        """Append, project what leaves the residual window; return the reconstruction (B, H_kv, T, D)."""
        _, _, valid = super().append(key_states, value_states, new_valid)
        overflow = self.keys.shape[-2] - self.policy.residual_length
        if overflow > 0:
            k_new = self.keys[:, :, :overflow] @ self.key_basis  # (B, H_kv, n, rk)
            v_new = self.values[:, :, :overflow] @ self.value_basis
            self.key_coef = k_new if self.key_coef is None else torch.cat([self.key_coef, k_new], dim=-2)
            self.value_coef = (
                v_new if self.value_coef is None else torch.cat([self.value_coef, v_new], dim=-2)
            )
            self.keys, self.values = self.keys[:, :, overflow:].clone(), self.values[:, :, overflow:].clone()
        keys = self.reconstruct(self.key_coef, self.key_basis, self.keys)
        values = self.reconstruct(self.value_coef, self.value_basis, self.values)
        return keys, values, valid

    @staticmethod
    def reconstruct(coef, basis, residual) -> torch.Tensor:
        """Projected tokens ``coef @ basis^T`` followed by the exact residual: (B, H_kv, T, D)."""
        if coef is None:
            return residual
        return torch.cat([coef @ basis.mT, residual], dim=-2)

    def stats(self) -> dict:
        return {
            **super().stats(),
            "key_rank": self.key_basis.shape[-1],
            "value_rank": self.value_basis.shape[-1],
            "tokens_projected": self.projected_length(),
            "calibration_source": self.policy.calibration["source"],
            "calibration_s": self.policy.calibration.get("seconds"),
        }
