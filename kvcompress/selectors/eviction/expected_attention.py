"""Expected Attention: score keys by the attention that future queries are expected to give them.

Devoto, Jeblick and Jégou, "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution", arXiv 2510.00636 (the method of NVIDIA kvpress's ``ExpectedAttentionPress``).

The prompt's queries are modelled as a Gaussian (mean, covariance). A future query at ``j`` positions
past the last token is that Gaussian rotated by RoPE for ``j`` more positions; averaging the rotation
over the next ``future_positions`` positions gives one Gaussian ``N(mu, Sigma)``. For a key ``k`` the
expected exponentiated logit is ``exp(s mu.k + s^2 k'Sigma k / 2)`` (the Gaussian's moment generating
function, ``s`` the softmax scale); normalised over the stored keys, averaged over the query heads of the
KV group and scaled by ``||v||``, it ranks the pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.fields import Bool, Choice, Int
from kvcompress.core.policy import Shape
from kvcompress.selectors.eviction.base import EvictionPolicy
from kvcompress.selectors.eviction.rope import mean_rotation, rope_frequencies, rotate
from kvcompress.selectors.eviction.scorer import ScorerPolicy, Step
from kvcompress.selectors.eviction.when import EVICT_AT


def query_statistics(query: torch.Tensor, inv_freq: torch.Tensor, weight: torch.Tensor):
    """Mean (B, H, D) and covariance (B, H, D, D) of a step's queries, each moved to the step's last real
    position (so that only relative rotations are needed: left padding and earlier evictions do not matter).

    Args:
        query: (B, H, q, D) after RoPE.
        inv_freq: (D/2,) the layer's RoPE frequencies.
        weight: (B, q) float, 1 for the queries that count (real, not sinks), else 0.
    """
    real = weight > 0
    dist = real.flip(-1).cumsum(-1).flip(-1) - 1  # (B, q): real queries after each one
    angles = dist.clamp(min=0)[:, None, :, None].float() * inv_freq.to(query.device)  # (B, 1, q, D/2)
    moved = rotate(query.float(), angles)  # (B, H, q, D)
    w = weight[:, None, :, None] / weight.sum(-1).clamp(min=1.0)[:, None, None, None]
    mean = (moved * w).sum(dim=2)  # (B, H, D)
    centred = (moved - mean[:, :, None]) * w.sqrt()
    return mean, centred.mT @ centred


def logit_terms(mean, cov, keys, scaling: float):
    """The two terms of each key's expected logit (B, H_kv, g, T), g query heads per KV head: the mean
    query's ``s mu.k`` and the covariance's ``s^2 k'Sigma k / 2`` (None when ``cov`` is None)."""
    b, h, d = mean.shape
    h_kv = keys.shape[1]
    k = keys.float()[:, :, None]  # (B, H_kv, 1, T, D)
    linear = (k * mean.view(b, h_kv, h // h_kv, 1, d)).sum(-1) * scaling  # (B, H_kv, g, T)
    if cov is None:
        return linear, None
    sigma = cov.view(b, h_kv, h // h_kv, d, d)
    return linear, ((k @ sigma) * k).sum(-1) * (scaling**2 / 2)


def expected_scores(mean, cov, keys, values, scaling: float, valid=None, value_norm: bool = True):
    """Expected attention (B, H_kv, T) of stored ``keys`` (B, H_kv, T, D) under future queries N(mean, cov)
    per query head (B, H, D) / (B, H, D, D); ``cov`` None uses the mean alone. ``valid`` (B or 1, 1 or H_kv,
    T) bool: the keys the softmax normalises over (padding and the sinks left out: the paper's reference
    code, kvpress, scores the sinks apart and keeps them); the others score 0."""
    linear, quadratic = logit_terms(mean, cov, keys, scaling)
    logits = linear if quadratic is None else linear + quadratic
    if valid is not None:
        logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
    scores = torch.softmax(logits, dim=-1).nan_to_num_(0.0).mean(dim=2)  # (B, H_kv, T)
    return scores * values.float().norm(dim=-1) if value_norm else scores


@dataclass
class ExpectedAttentionPolicy(ScorerPolicy):
    """Keep, per layer and KV head, the ``budget`` (or ``1 - compression_ratio``) pairs with the highest
    expected attention from the next ``future_positions`` queries, plus the first ``sink_tokens``.

    The query statistics come from the step's own queries (all of a one-shot prefill; each chunk's under a
    chunked prefill), so it needs no question: query-agnostic, at no extra forward pass. Decode tokens are
    appended. The RoPE frequencies are read from the model by ``build_cache`` (``prepare``).

    Args:
        future_positions: future query positions the RoPE rotation is averaged over.
        sink_tokens: first real tokens, always kept, left out of the statistics and of the softmax.
        covariance: use the queries' covariance (else the mean alone).
        value_norm: multiply the expected attention by each value's norm.
    """

    prefill_only = (
        "its scores are moments of a step's queries (mean and covariance), which a one-token decode step "
        "cannot estimate"
    )
    FORMULA = True  # the memory formulas below are this class's own
    TEST_PARAMS = {"budget": 12, "compression_ratio": None, "future_positions": 16, "sink_tokens": 2}
    FUZZ = [
        {**alt, "future_positions": (1, 64), "sink_tokens": (0, 6), "covariance": [True, False],
         "value_norm": [True, False]}
        for alt in EvictionPolicy.FUZZ
    ]  # fmt: skip

    future_positions: int = Int(512, low=1)
    sink_tokens: int = Int(4, low=0)
    covariance: bool = Bool(True)
    value_norm: bool = Bool(True)
    evict_at: str = Choice("prefill", EVICT_AT)

    def __post_init__(self):
        super().__post_init__()
        self.rope: list[torch.Tensor] | None = None  # per-layer inv_freq, read from the model by prepare

    def prepare(self, model) -> None:
        super().prepare(model)
        self.rope = rope_frequencies(model)

    def frequencies(self, layer_idx: int) -> torch.Tensor:
        if self.rope is None:
            raise RuntimeError(
                "expected_attention needs the model's RoPE: build it with build_cache(policy, model)"
            )
        return self.rope[layer_idx]

    def pinned(self, step: Step) -> torch.Tensor:
        """The first ``sink_tokens`` real tokens, kept whatever their score."""
        return step.first_real(self.sink_tokens)

    def score(self, step: Step) -> torch.Tensor:
        """Expected attention (B, H_kv, T) of the stored pairs under the step's query statistics (a step of
        several tokens: ``evict_at`` is prefill only), the sinks left out of the softmax (kvpress)."""
        query, valid = step.query, step.valid
        inv_freq = self.frequencies(step.layer_idx)
        q = query.shape[2]
        real = torch.ones(query.shape[0], q, dtype=torch.bool, device=query.device)
        if valid is not None:
            real = valid[:, 0, -q:]
        weight = real.float()
        if step.seen == q:  # the first step holds the sinks: outliers, left out of the statistics
            weight = weight * (real.cumsum(-1) > self.sink_tokens)
        mean, cov = query_statistics(query, inv_freq, weight)
        turn = mean_rotation(inv_freq.to(query.device), self.future_positions)  # (D, D)
        mean, cov = mean @ turn.mT, (turn @ cov @ turn.mT if self.covariance else None)
        sinks = self.pinned(step)
        scored = ~sinks if valid is None else valid & ~sinks
        return expected_scores(mean, cov, step.keys, step.values, step.scaling, scored, self.value_norm)

    def kept_tokens(self, s: Shape) -> int:
        """The prompt compressed to ``min(n, keep_count(n))``; decode tokens appended."""
        return min(s.prefill, self.keep_count(s.prefill)) + s.decode
