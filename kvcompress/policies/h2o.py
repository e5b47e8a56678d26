"""H2O: heavy hitters (accumulated attention) plus a recent window, enforced at every step.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv 2306.14048.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.attention import window_scores
from kvcompress.policies.base import ModelSpec
from kvcompress.policies.eviction import EvictionLayer, EvictionPolicy


@dataclass
class H2OPolicy(EvictionPolicy):
    """Keep the tokens with the largest accumulated attention plus the ``recent`` newest ones.

    Each stored token accumulates the attention it receives (averaged over the query heads of its KV
    group): from every decode query, and at prefill from the last ``window`` prompt queries. The paper
    accumulates over all prompt queries; that is a T x T matrix, so we use the last ``window`` ones.

    Args:
        budget / compression_ratio: see ``EvictionPolicy``.
        recent: newest tokens always kept; None gives half of the kept tokens, the paper's equal split.
        window: prompt queries whose attention seeds the accumulator at prefill.
    """

    recent: int | None = None
    window: int = 32

    def __post_init__(self):
        super().__post_init__()
        if self.recent is not None and self.recent < 0:
            raise ValueError(f"h2o.recent={self.recent} must be >= 0 or null (half of the kept tokens)")
        if self.window < 1:
            raise ValueError(f"h2o.window={self.window} must be >= 1")
        if self.budget is not None and self.recent is not None and self.recent > self.budget:
            raise ValueError(
                f"h2o.budget={self.budget} is below recent={self.recent}: the recent window is always "
                "kept, so budget must be >= recent"
            )

    def layer(self, layer_idx: int, spec: ModelSpec) -> H2OLayer:
        return H2OLayer(self, layer_idx, spec)


class H2OLayer(EvictionLayer):
    """Holds the accumulated scores ``acc`` (B, H_kv, T) float32 next to the keys they rank."""

    def __init__(self, policy, layer_idx, spec):
        super().__init__(policy, layer_idx, spec)
        self.acc: torch.Tensor | None = None

    def append(self, key_states, value_states, new_valid):
        b, h, q, _ = key_states.shape
        zeros = torch.zeros(b, h, q, dtype=torch.float32, device=key_states.device)
        self.acc = zeros if self.acc is None else torch.cat([self.acc, zeros], dim=-1)
        return super().append(key_states, value_states, new_valid)

    def observe_attention(self, query, key, scaling: float) -> None:
        w = min(self.policy.window, query.shape[2])
        self.acc += window_scores(query[:, :, -w:], key, scaling, self.valid).sum(dim=2)  # (B, H_kv, T)
        k = self.target()
        if self.stored_length() > k:
            recent = k // 2 if self.policy.recent is None else self.policy.recent
            self.select(self.acc, k, protect=recent)

    def keep(self, idx: torch.Tensor) -> None:
        super().keep(idx)
        self.acc = self.acc.gather(-1, idx.sort(dim=-1).values.expand(-1, self.acc.shape[1], -1))

    def reorder_cache(self, beam_idx) -> None:
        super().reorder_cache(beam_idx)
        if self.acc is not None:
            self.acc = self.acc.index_select(0, beam_idx.to(self.acc.device))

    def reset(self) -> None:
        super().reset()
        self.acc = None

    def tensors(self) -> list[torch.Tensor]:
        return [*super().tensors(), self.acc]
