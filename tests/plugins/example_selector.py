"""An example selector defined in one file (plus ``conf/policy/knorm.yaml`` beside it): every generic test
(contract over every storage, fuzz, memory model, bad inputs) picks it up with no other change.

Key-norm eviction: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", arXiv 2406.11430, found that keys with a low L2 norm draw high attention, so once a layer
holds more than its budget it keeps the lowest-norm keys per row and KV head. It needs no attention score.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.fields import Int
from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy


class KnormLayer(EvictionLayer):
    """Ranks the stored keys (B, H_kv, T, D) by their L2 norm; only the budget logic is inherited."""

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        k = self.target()
        if self.stored_length() > k:
            self.select(-key.float().norm(dim=-1), k, protect=self.policy.recent)  # (B, H_kv, T)


@dataclass
class KnormPolicy(EvictionPolicy):
    """Keep the ``budget`` (or ``1 - compression_ratio``) lowest-norm keys, plus the ``recent`` newest."""

    layer_class = KnormLayer
    FORMULA = True  # the memory formulas below are this class's own
    TEST_PARAMS = {"budget": 12, "compression_ratio": None}
    FUZZ = [{**alt, "recent": (0, 4)} for alt in EvictionPolicy.FUZZ]

    recent: int = Int(0, low=0)  # the YAML sets 1
