"""Low-rank storage (coefficients in a calibrated basis, exact residual): the layer of ``LowRankPolicy``.

After Palu, arXiv 2407.21118 (a low-rank latent cached, reconstructed on read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcompress.policies.base import ModelSpec, PolicyLayer

if TYPE_CHECKING:
    from kvcompress.policies.low_rank import LowRankPolicy


class LowRankLayer(PolicyLayer):
    """Coefficients ``key_coef``/``value_coef`` (B, H_kv, T_c, r) of older tokens (int8 codes with scales
    ``key_scale``/``value_scale`` (B, H_kv, T_c, 1) if asked); exact residual tokens in ``keys``/``values``
    (B, H_kv, R, D); the layer's bases (H_kv, D, r), counted once per layer."""

    STORED = ("key_coef", "value_coef", "key_scale", "value_scale")

    def __init__(self, policy: LowRankPolicy, layer_idx: int, spec: ModelSpec, key_basis, value_basis):
        super().__init__(policy, layer_idx, spec)
        own = torch.contiguous_format  # a copy with its own storage, not a view of the whole calibration
        self.key_basis = key_basis.clone(memory_format=own)
        self.value_basis = value_basis.clone(memory_format=own)
        self.key_coef = self.value_coef = self.key_scale = self.value_scale = None

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_basis = self.key_basis.to(self.device, self.dtype)
        self.value_basis = self.value_basis.to(self.device, self.dtype)

    def reset(self) -> None:
        super().reset()
        self.key_coef = self.value_coef = self.key_scale = self.value_scale = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        for name in self.STORED:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, beam_idx.to(t.device)))

    def projected_length(self) -> int:
        return 0 if self.key_coef is None else self.key_coef.shape[-2]

    def stored_length(self) -> int:
        return self.projected_length() + super().stored_length()

    def tensors(self) -> list[torch.Tensor]:
        return (
            super().tensors() + [getattr(self, n) for n in self.STORED] + [self.key_basis, self.value_basis]
        )

    def append(self, key_states, value_states, new_valid):
        """Append, project what leaves the residual window; return the reconstruction (B, H_kv, T, D)."""
        _, _, valid = super().append(key_states, value_states, new_valid)
        overflow = self.keys.shape[-2] - self.policy.residual_length
        if overflow > 0:
            kc, ks = self._project(self.keys[:, :, :overflow], self.key_basis)  # (B, H_kv, n, rk)
            vc, vs = self._project(self.values[:, :, :overflow], self.value_basis)
            self.key_coef, self.key_scale = _cat(self.key_coef, kc), _cat(self.key_scale, ks)
            self.value_coef, self.value_scale = _cat(self.value_coef, vc), _cat(self.value_scale, vs)
            self.keys, self.values = self.keys[:, :, overflow:].clone(), self.values[:, :, overflow:].clone()
        keys = _reconstruct(self.key_coef, self.key_scale, self.key_basis, self.keys)
        values = _reconstruct(self.value_coef, self.value_scale, self.value_basis, self.values)
        return keys, values, valid

    def _project(self, x: torch.Tensor, basis: torch.Tensor):
        """Coefficients of ``x`` (B, H_kv, n, D) in ``basis``: floats, or int8 codes and per-token scales."""
        coef = x @ basis  # (B, H_kv, n, r)
        if not self.policy.int8_coefficients:
            return coef, None
        scale = coef.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(coef.dtype).tiny) / 127
        return torch.round(coef / scale).to(torch.int8), scale

    def stats(self) -> dict:
        return {
            **super().stats(),
            "key_rank": self.key_basis.shape[-1],
            "value_rank": self.value_basis.shape[-1],
            "tokens_projected": self.projected_length(),
            "calibration_source": self.policy.calibration["source"],
            "calibration_s": self.policy.calibration.get("seconds"),
        }


def _cat(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    return new if old is None or new is None else torch.cat([old, new], dim=-2)


def _reconstruct(coef, scale, basis, residual) -> torch.Tensor:
    """Projected tokens ``coef @ basis^T`` followed by the exact residual: (B, H_kv, T, D)."""
    if coef is None:
        return residual
    coef = coef if scale is None else coef.to(scale.dtype) * scale
    return torch.cat([coef @ basis.mT, residual], dim=-2)
