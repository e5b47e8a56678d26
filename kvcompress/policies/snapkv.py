"""SnapKV: the prompt's last queries (observation window) vote for the prefix tokens worth keeping.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompress.attention import window_scores
from kvcompress.policies.base import ModelSpec
from kvcompress.policies.eviction import EvictionLayer, EvictionPolicy

POOLINGS = ("max", "avg")


@dataclass
class SnapKVPolicy(EvictionPolicy):
    """Compress each prefill step to the budget: sum the attention of the last ``window`` queries over the
    prefix, pool it along the sequence (``kernel_size``, ``pooling``) so neighbours of a hit survive
    with it, keep the top-k per KV head plus the window itself. Decode tokens are appended; with
    ``slack`` set, the cache is re-compressed (observation window = the last ``window`` queries) whenever
    it exceeds ``budget + slack``.
    """

    window: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    slack: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"snapkv.window={self.window} must be >= 1")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"snapkv.kernel_size={self.kernel_size} must be an odd integer >= 1")
        if self.pooling not in POOLINGS:
            raise ValueError(f"snapkv.pooling={self.pooling!r} is not supported; allowed: {list(POOLINGS)}")
        if self.slack is not None and self.slack < 0:
            raise ValueError(f"snapkv.slack={self.slack} must be >= 0 or null (never re-compress)")

    @property
    def reserved(self) -> int:
        return self.window

    def layer(self, layer_idx: int, spec: ModelSpec) -> SnapKVLayer:
        return SnapKVLayer(self, layer_idx, spec)


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Smooth (B, H_kv, T) scores along T with a stride-1 pool that keeps the length."""
    if kernel_size == 1:
        return scores
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(scores, kernel_size=kernel_size, stride=1, padding=kernel_size // 2)


class SnapKVLayer(EvictionLayer):
    """With ``slack`` set, also holds the last ``window`` queries (B, H, w, D) for re-compression."""

    def __init__(self, policy, layer_idx, spec):
        super().__init__(policy, layer_idx, spec)
        self.queries: torch.Tensor | None = None

    def observe_attention(self, query, key, scaling: float) -> None:
        p, k, stored = self.policy, self.target(), self.stored_length()
        if p.slack is not None:  # the stream's last `window` queries, aligned with the last stored keys
            q = query if self.queries is None else torch.cat([self.queries, query], dim=2)
            self.queries = q[:, :, -p.window :].clone()
        if query.shape[2] > 1 and stored > k:
            self.compress_with(query, key, scaling, k)
        elif query.shape[2] == 1 and p.slack is not None and stored > k + p.slack:
            self.compress_with(self.queries, key, scaling, k)

    def compress_with(self, queries, key, scaling: float, k: int) -> None:
        """Keep the window (the last ``w`` tokens) and the ``k - w`` prefix tokens the window votes for."""
        w = min(self.policy.window, queries.shape[2], k)
        votes = window_scores(queries[:, :, -w:], key, scaling, self.valid).sum(dim=2)  # (B, H_kv, T)
        t = votes.shape[-1]
        prefix = pool_scores(votes[..., : t - w], self.policy.kernel_size, self.policy.pooling)
        self.select(torch.cat([prefix, votes[..., t - w :]], dim=-1), k, protect=w)

    def reorder_cache(self, beam_idx) -> None:
        super().reorder_cache(beam_idx)
        if self.queries is not None:
            self.queries = self.queries.index_select(0, beam_idx.to(self.queries.device))

    def reset(self) -> None:
        super().reset()
        self.queries = None

    def tensors(self) -> list[torch.Tensor]:
        return [*super().tensors(), self.queries]
