"""The layer of selectors that rank the stored keys alone (keydiff, knorm): a subclass writes ``key_scores``.

Such a ranking reads keys only, so the step asks attention for no probabilities and any backend of the dense
read serves it; it does not depend on stored order, so a decode step's one eviction (``evict_at: always``)
moves the newest token into the hole (O(1)); and a crop is exact wherever no eviction happened among the
tokens it removes (``core.rollback`` checks that), the keys being the layer's only state.
"""

from __future__ import annotations

import torch

from kvcompress.selectors.eviction.base import EvictionLayer


class KeyScoredLayer(EvictionLayer):
    """Once the layer holds more than its target, keeps each KV head's ``k`` keys of highest
    ``key_scores``, after the step's attention read them all."""

    order_free = True
    observed_probs = "none"  # observes after attention, from the keys alone

    def key_scores(self, key: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T) priority of each stored key (B, H_kv, T, D), higher kept."""
        raise NotImplementedError

    def never_crops(self) -> str | None:
        return None

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        k = self.target()
        if self.stored_length() > k:
            self.select(self.key_scores(key), k)
