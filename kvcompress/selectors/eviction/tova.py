"""TOVA: evict the token the current query attends to least.

Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.fields import Choice
from kvcompress.selectors.eviction.scorer import ScorerPolicy, Step
from kvcompress.selectors.eviction.when import EVICT_AT


@dataclass
class TOVAPolicy(ScorerPolicy):
    """Once the layer holds more than its budget, drop the tokens with the lowest attention from the
    step's last query, averaged over all heads of the layer (the paper's layer-wise variant: every head
    keeps the same tokens, as in the authors' cache). Nothing is protected, not even the newest token.
    ``evict_at: always`` (the paper's: a multi-state RNN drops one state per generated token); ``prefill``
    ranks the prompt by its last query once, as kvpress's ``TOVAPress``."""

    asks = "attention"  # the last query's probabilities: over quant, from the codes
    adaptive_decode = True  # scored by the decode query alone: pairs can compete across heads at each step
    MEMORY_VARIANTS = [
        {"budget": None, "compression_ratio": 0.25},
        {"budget": 10, "compression_ratio": None, "evict_at": "prefill"},
    ]

    evict_at: str = Choice("always", EVICT_AT)  # the paper's: one state dropped per generated token

    def score(self, step: Step) -> torch.Tensor:
        """The step's last query's attention (B, H_kv, T), each KV head's own with ``adaptive`` (its pairs
        compete with the other heads'), else averaged over the layer (B, 1, T)."""
        last = step.attention(1)[:, :, 0]
        return last if self.adaptive else last.mean(dim=1, keepdim=True)
