"""TOVA: evict the token the current query attends to least.

Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.attention import window_scores
from kvcompress.policies.base import ModelSpec
from kvcompress.policies.eviction import EvictionLayer, EvictionPolicy


@dataclass
class TOVAPolicy(EvictionPolicy):
    """Once the layer holds more than its budget, drop the tokens with the lowest attention from the
    step's last query, averaged over all heads of the layer (the paper's layer-wise variant: every head
    keeps the same tokens, as in the authors' cache). Nothing is protected, not even the newest token."""

    def layer(self, layer_idx: int, spec: ModelSpec) -> TOVALayer:
        return TOVALayer(self, layer_idx, spec)


class TOVALayer(EvictionLayer):
    """Stateless besides the keys/values: the scores come from the current query only, so stored order
    never matters and a decode step's single eviction moves the newest token into the hole (O(1))."""

    order_free = True

    def observe_attention(self, query, key, scaling: float) -> None:
        k = self.target()
        if self.stored_length() <= k:
            return
        probs = window_scores(query[:, :, -1:], key, scaling, self.valid)  # (B, H_kv, 1, T)
        self.select(probs[:, :, 0].mean(dim=1, keepdim=True), k)  # (B, 1, T)
