"""KeyDiff: keep the keys least like the others, with no attention score.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv 2504.15364. Each stored key is ranked by its cosine similarity to
the anchor, the mean of the layer's unit keys (per row and KV head): the most similar are the most
redundant and go first. The ranking reads keys only, so the step asks attention for no probabilities and
any backend of the dense read serves it, the model's own SDPA or flash attention included. A step that
evicts needs every stored key as a tensor, so over quantized storage it reads the dequantized copy: every
decode step with ``evict_at: always``; with ``prefill`` decode steps read the codes in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompress.core.fields import Choice
from kvcompress.selectors.eviction.scorer import ScorerPolicy, Step
from kvcompress.selectors.eviction.when import EVICT_AT


def keydiff_scores(key: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """(B, H_kv, T) float32 priority of each stored key (B, H_kv, T, D): minus its cosine similarity to the
    mean unit key of its row and head, taken over real tokens only (``valid`` (B, 1 or H_kv, T), False on
    padding slots, or None): a padded row ranks its tokens as the same row alone."""
    unit = F.normalize(key.float(), dim=-1)  # (B, H_kv, T, D)
    if valid is None:
        anchor = unit.mean(-2, keepdim=True)  # (B, H_kv, 1, D)
    else:
        real = valid[..., None].float()  # (B, 1 or H_kv, T, 1)
        anchor = (unit * real).sum(-2, keepdim=True) / real.sum(-2, keepdim=True).clamp_min(1)
    return -(unit * F.normalize(anchor, dim=-1)).sum(-1)  # (B, H_kv, T)


@dataclass
class KeyDiffPolicy(ScorerPolicy):
    """Keep, per layer and KV head, the ``budget`` (or ``1 - compression_ratio``) keys least similar to
    the mean key (KeyDiff, arXiv 2504.15364); needs no attention scores. ``evict_at: always`` is the
    paper's: a fixed cache size throughout, the prompt processed block by block and every decode step
    evicting; ``prefill`` ranks the prompt once, as kvpress's ``KeyDiffPress``."""

    MEMORY_VARIANTS = [
        {"budget": None, "compression_ratio": 0.25},
        {"budget": 10, "compression_ratio": None, "evict_at": "prefill"},
    ]

    evict_at: str = Choice("always", EVICT_AT)  # the paper's: every decode step evicts

    def score(self, step: Step) -> torch.Tensor:
        return keydiff_scores(step.keys, step.valid)
