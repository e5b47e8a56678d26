"""H2O: heavy hitters (accumulated attention) plus a recent window, enforced at every step.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv 2306.14048.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.attention import window_scores
from kvcompress.policies.base import ModelSpec
from kvcompress.policies.eviction import _BIG, EvictionLayer, EvictionPolicy


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
    """Holds the accumulated scores ``acc`` (B, H_kv, T) float32 and each stored token's position ``pos``
    (B, H_kv, T) int32 next to the keys they rank. The recent window is found by position, not by stored
    order, so a decode step's single eviction moves the newest token into the hole (O(1), ``drop_one``)."""

    order_free = True

    def __init__(self, policy, layer_idx, spec):
        super().__init__(policy, layer_idx, spec)
        self.acc: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None

    def append(self, key_states, value_states, new_valid):
        b, h, q, _ = key_states.shape
        zeros = torch.zeros(b, h, q, dtype=torch.float32, device=key_states.device)
        new_pos = torch.arange(self.seen, self.seen + q, dtype=torch.int32, device=key_states.device)
        new_pos = new_pos.expand(b, h, q)
        self.acc = zeros if self.acc is None else torch.cat([self.acc, zeros], dim=-1)
        self.pos = new_pos.clone() if self.pos is None else torch.cat([self.pos, new_pos], dim=-1)
        return super().append(key_states, value_states, new_valid)

    def observe_attention(self, query, key, scaling: float) -> None:
        w = min(self.policy.window, query.shape[2])
        self.acc += window_scores(query[:, :, -w:], key, scaling, self.valid).sum(dim=2)  # (B, H_kv, T)
        k = self.target()
        if self.stored_length() > k:
            recent = k // 2 if self.policy.recent is None else self.policy.recent
            newest = self.pos.double()
            protected = newest >= self.seen - recent  # the `recent` newest positions, wherever stored
            self.select(torch.where(protected, _BIG + newest, self.acc.double()), k)  # newest win ties

    def keep(self, idx: torch.Tensor, is_sorted: bool = False) -> torch.Tensor:
        idx = super().keep(idx, is_sorted)
        self.acc = self.acc.gather(-1, idx.expand(-1, self.acc.shape[1], -1))
        self.pos = self.pos.gather(-1, idx.expand(-1, self.pos.shape[1], -1))
        return idx

    def drop_one(self, slot: torch.Tensor) -> bool:
        if not super().drop_one(slot):
            return False
        t = self.acc.shape[-1]
        for name in ("acc", "pos"):
            x = getattr(self, name)
            x.scatter_(-1, slot.expand(-1, x.shape[1], -1), x[..., t - 1 :].clone())
            setattr(self, name, x[..., : t - 1])
        return True

    def reorder_cache(self, beam_idx) -> None:
        super().reorder_cache(beam_idx)
        if self.acc is not None:
            self.acc = self.acc.index_select(0, beam_idx.to(self.acc.device))
            self.pos = self.pos.index_select(0, beam_idx.to(self.pos.device))

    def reset(self) -> None:
        super().reset()
        self.acc = self.pos = None

    def tensors(self) -> list[torch.Tensor]:
        return [*super().tensors(), self.acc, self.pos]
