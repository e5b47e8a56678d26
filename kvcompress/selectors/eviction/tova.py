"""TOVA: evict the token the current query attends to least.

Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy
from kvcompress.selectors.eviction.when import EVICT_AT


class TOVALayer(EvictionLayer):
    """Stateless besides the keys/values: the scores come from the current query only, so stored order
    never matters and a decode step's single eviction moves the newest token into the hole (O(1))."""

    order_free = True
    reads_as_stored = True  # scored by the decode query over every stored token: over quant, from the codes

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        k = self.target()
        if not (self.due() if self.flat else self.stored_length() > k):
            return
        last = self.scores(query, key, scaling, 1, probs)  # (B, H_kv, 1, T)
        if self.policy.adaptive:  # each head's own scores: its pairs compete with the other heads'
            self.select(last[:, :, 0], k)
        else:
            self.select(last[:, :, 0].mean(dim=1, keepdim=True), k)  # (B, 1, T)


@dataclass
class TOVAPolicy(EvictionPolicy):
    """Once the layer holds more than its budget, drop the tokens with the lowest attention from the
    step's last query, averaged over all heads of the layer (the paper's layer-wise variant: every head
    keeps the same tokens, as in the authors' cache). Nothing is protected, not even the newest token.
    ``evict_at: always`` (the paper's: a multi-state RNN drops one state per generated token); ``prefill``
    ranks the prompt by its last query once, as kvpress's ``TOVAPress``."""

    layer_class = TOVALayer
    adaptive_decode = True  # scored by the decode query alone: pairs can compete across heads at each step
    FORMULA = True  # the memory formulas below are this class's own
    TEST_PARAMS = {"budget": 12, "compression_ratio": None}
    MEMORY_VARIANTS = [
        {"budget": None, "compression_ratio": 0.25},
        {"budget": 10, "compression_ratio": None, "evict_at": "prefill"},
    ]
    FUZZ = [{**alt, "evict_at": list(EVICT_AT)} for alt in EvictionPolicy.FUZZ]
