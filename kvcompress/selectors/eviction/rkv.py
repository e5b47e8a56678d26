"""R-KV: keep tokens that are important and not redundant, re-compressing as a long generation grows.

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models", arXiv 2505.24133. SnapKV's
schedule (``snapkv.SnapKVLayer``: the prompt compressed to the budget, then a re-compression whenever the
layer holds ``slack`` tokens over it, voted by the last ``observation_window`` queries, which stay) with the
paper's score for the older tokens: ``mix_lambda * importance - (1 - mix_lambda) * redundancy``, where
importance is the window's attention over them (renormalized over them, averaged over the window's queries
and each KV group's query heads, max-pooled along the sequence) and redundancy is the softmax over tokens
of each key's mean cosine similarity to the others. A key's similarity to its newest similar key (cosine
above ``similarity_threshold``) is not counted, so the newest of a run of near-copies counts as the least
redundant of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompress.core.fields import Choice, Float, Int
from kvcompress.selectors.eviction.snapkv import POOLINGS, SnapKVLayer, SnapKVPolicy, pool_scores
from kvcompress.selectors.eviction.when import EVICT_AT


def redundancy(key: torch.Tensor, valid: torch.Tensor | None, threshold: float) -> torch.Tensor:
    """(B, H_kv, T) float32 redundancy of each key (B, H_kv, T, D): the softmax over real tokens of its mean
    cosine similarity to the other real keys (``valid`` (B, 1 or H_kv, T), False on padding, or None),
    where each key's similarity to its newest similar key (cosine above ``threshold``) counts as 0.
    O(T^2) per row and KV head."""
    unit = F.normalize(key.float(), dim=-1)  # (B, H_kv, T, D)
    sim = torch.matmul(unit, unit.transpose(-1, -2))  # (B, H_kv, T, T): row i, column j
    t = sim.shape[-1]
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    real = None
    if valid is not None:
        real = valid.expand_as(sim[..., 0])  # (B, H_kv, T)
        sim = sim * (real[..., :, None] & real[..., None, :])
    ar = torch.arange(t, device=key.device)
    newest = torch.where(sim > threshold, ar, -1).amax(-1, keepdim=True)  # (B, H_kv, T, 1): -1 if none
    sim = sim.masked_fill((ar == newest) & (newest >= 0), 0.0)
    if real is None:
        return torch.softmax(sim.sum(-2) / t, dim=-1)
    mean = sim.sum(-2) / real.sum(-1, keepdim=True).clamp_min(1)  # (B, H_kv, T) over real rows
    return torch.softmax(mean.masked_fill(~real, float("-inf")), dim=-1).nan_to_num_(0.0)


class RKVLayer(SnapKVLayer):
    """SnapKV's layer and schedule; the older tokens ranked by importance minus redundancy."""

    def compress_with(self, queries, key, scaling: float, k: int) -> None:
        """Keep the window (the last ``w`` tokens) and the ``k - w`` older tokens of best R-KV score."""
        p = self.policy
        w = min(p.observation_window, queries.shape[2], k)
        t = key.shape[-2]
        probs = self.scores(queries, key, scaling, w)[..., : t - w]  # (B, H_kv, w, T - w)
        importance = (probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)).mean(dim=2)  # (B, H_kv, T - w)
        importance = pool_scores(importance, p.kernel_size, p.pooling)
        older = redundancy(key, self.valid, p.similarity_threshold)[..., : t - w]
        score = p.mix_lambda * importance - (1.0 - p.mix_lambda) * older
        self.select(torch.cat([score, torch.zeros_like(key[..., t - w :, 0], dtype=score.dtype)], -1), k, w)


@dataclass
class RKVPolicy(SnapKVPolicy):
    """Keep, per layer and KV head, the ``budget`` (or ``1 - compression_ratio``) tokens of best importance
    minus redundancy (R-KV, arXiv 2505.24133): the last ``observation_window`` queries vote and stay, and
    the layer re-compresses each time it holds ``slack`` tokens over its budget (the paper's buffer).

    Args:
        mix_lambda: weight of importance against redundancy (the paper's lambda).
        similarity_threshold: cosine above which a key counts as a near-copy of another.
    """

    layer_class = RKVLayer
    FORMULA = True  # SnapKV's schedule and stored queries: the inherited formulas describe it exactly
    # FUZZ is SnapKV's, slack None: with slack the layer also holds its window's queries, more than the full
    # cache holds on the fuzzer's shortest sequences; TEST_PARAMS (slack 3) and its test re-compress at decode

    observation_window: int = Int(8, low=1)
    kernel_size: int = Int(7, low=1)
    pooling: str = Choice("max", POOLINGS)
    slack: int | None = Int(128, low=0, null=True)
    mix_lambda: float = Float(0.1, 0.0, 1.0)
    similarity_threshold: float = Float(0.5, -1.0, 1.0)
    evict_at: str = Choice("always", EVICT_AT)  # the paper compresses the decoded reasoning as it grows
