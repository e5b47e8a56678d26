"""SnapKV: the prompt's last queries (observation window) vote for the prefix tokens worth keeping.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompress.core.fields import Choice, Int
from kvcompress.core.policy import Shape
from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy
from kvcompress.selectors.eviction.when import EVICT_AT

POOLINGS = ("max", "avg")


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Smooth (B, H_kv, T) scores along T with a stride-1 pool that keeps the length."""
    if kernel_size == 1:
        return scores
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(scores, kernel_size=kernel_size, stride=1, padding=kernel_size // 2)


class SnapKVLayer(EvictionLayer):
    """With ``slack`` set, also holds the last ``observation_window`` queries (B, H, w, D)."""

    per_row = (*EvictionLayer.per_row, "queries")

    def __init__(self, policy, layer_idx, spec, store):
        super().__init__(policy, layer_idx, spec, store)
        self.window_cut = 0  # compressions whose window was cut by a short forward or a small budget

    def reset(self) -> None:
        super().reset()
        self.window_cut = 0

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        p, k, stored = self.policy, self.target(), self.stored_length()
        w = p.observation_window
        if p.slack is not None:  # the stream's last `w` queries, aligned with the last stored keys
            q = query if self.queries is None else torch.cat([self.queries, query], dim=2)
            self.queries = q[:, :, -w:].clone()
        if query.shape[2] > 1 and stored > k:
            self.compress_with(query, key, scaling, k)  # slack is None unless evict_at is always
        elif query.shape[2] == 1 and p.slack is not None and stored > k + p.slack:
            self.compress_with(self.queries, key, scaling, k)

    def compress_with(self, queries, key, scaling: float, k: int) -> None:
        """Keep the window (the last ``w`` tokens) and the ``k - w`` prefix tokens the window votes for."""
        w = min(self.policy.observation_window, queries.shape[2], k)
        self.window_cut += w < self.policy.observation_window  # a prompt (or budget) shorter than the window
        votes = self.scores(queries, key, scaling, w).sum(dim=2)  # (B, H_kv, T)
        t = votes.shape[-1]
        prefix = pool_scores(votes[..., : t - w], self.policy.kernel_size, self.policy.pooling)
        self.select(torch.cat([prefix, votes[..., t - w :]], dim=-1), k, protect=w)

    def stats(self) -> dict:
        return {**super().stats(), "observation_window": self.policy.observation_window,
                "window_cut": self.window_cut}  # fmt: skip


@dataclass
class SnapKVPolicy(EvictionPolicy):
    """Compress each prefill step to the budget: sum the attention of the last ``observation_window``
    queries over the prefix, pool it along the sequence (``kernel_size``, ``pooling``) so neighbours of a
    hit survive with it, keep the top-k per KV head plus the window itself. With ``evict_at: prefill`` (the
    paper's) decode tokens are appended; with ``always`` the cache is re-compressed (over the last
    ``observation_window`` queries) whenever it exceeds ``budget + slack`` (``slack`` 0 if unset).
    """

    layer_class = SnapKVLayer
    FORMULA = True  # the memory formulas below are this class's own
    TEST_PARAMS = {
        "budget": 12, "compression_ratio": None, "observation_window": 4, "kernel_size": 3, "slack": 3,
        "evict_at": "always",
    }  # fmt: skip
    # slack=None: with slack SnapKV also holds its last queries (counted in memory_bytes), which on
    # sequences shorter than about budget + 1.5 x window is more than the full cache holds.
    FUZZ = [
        {**alt, "observation_window": (1, 8), "kernel_size": [1, 3, 5], "slack": None, "evict_at": "prefill"}
        for alt in EvictionPolicy.FUZZ
    ]
    MEMORY_VARIANTS = [
        {"budget": None, "compression_ratio": 0.4},
        {"budget": 150, "compression_ratio": None, "observation_window": 8, "slack": 5, "evict_at": "always"},
        {"budget": None, "compression_ratio": 0.5, "observation_window": 8, "slack": 2, "evict_at": "always"},
    ]

    observation_window: int = Int(32, low=1)
    kernel_size: int = Int(5, low=1)
    pooling: str = Choice("avg", POOLINGS)
    slack: int | None = Int(None, low=0, null=True)
    evict_at: str = Choice("prefill", EVICT_AT)  # the paper's: the prompt is compressed once

    def __post_init__(self):
        super().__post_init__()
        if self.kernel_size % 2 == 0:
            raise ValueError(f"snapkv.kernel_size={self.kernel_size} must be an odd integer >= 1")
        if self.evict_at == "prefill" and self.slack is not None:
            raise ValueError(
                f"{self.name}.slack={self.slack} re-compresses at decode steps, but evict_at='prefill': set "
                "evict_at=always (or slack=null)"
            )
        if self.evict_at == "always" and self.slack is None:
            self.slack = 0  # re-compressed at every decode step over the budget

    @property
    def reserved(self) -> int:
        return self.observation_window

    def kept_tokens(self, s: Shape) -> int:
        """The prompt compressed to ``min(n, keep_count(n))``; decode tokens appended, or with ``slack`` a
        step that leaves more than ``keep_count(t) + slack`` compresses back to ``keep_count(t)``."""
        stored = min(s.prefill, self.keep_count(s.prefill))
        for t in range(s.prefill + 1, s.total + 1):
            stored += 1
            if self.slack is not None and stored > self.keep_count(t) + self.slack:
                stored = self.keep_count(t)
        return stored

    def state_bytes(self, s: Shape, kept: int) -> int:
        """With ``slack``: the last ``min(window, T)`` queries (B, H, w, D) in the model dtype."""
        if self.slack is None:
            return 0
        return s.batch * s.heads * min(self.observation_window, s.total) * s.head_dim * s.dtype_bytes
