"""An example selector defined in one file (plus ``conf/policy/vnorm.yaml`` beside it): every generic test
(contract over every storage, fuzz, memory model, bad inputs) picks it up with no other change.

Value-norm eviction, a toy for docs/extending.md and not a published method: once a layer holds more than
its budget it keeps, per row and KV head, the tokens whose values have the largest L2 norm (their output
weighs most when attended), plus the ``recent`` newest. It needs no attention score. (The published
key-norm rule, arXiv 2406.11430, is the package's own ``knorm``.)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.fields import Int
from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy


class VnormLayer(EvictionLayer):
    """Ranks the stored tokens by their values' L2 norm; only the budget logic is inherited."""

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        k = self.target()
        if self.stored_length() > k:
            values = self.store.read()[1]  # (B, H_kv, T, D), dequantized where the storage packs them
            self.select(values.float().norm(dim=-1), k, protect=self.policy.recent)  # (B, H_kv, T)


@dataclass
class VnormPolicy(EvictionPolicy):
    """Keep the ``budget`` (or ``1 - compression_ratio``) largest-norm values, plus the ``recent`` newest."""

    layer_class = VnormLayer
    FORMULA = True  # the memory formulas below are this class's own
    TEST_PARAMS = {"budget": 12, "compression_ratio": None}
    FUZZ = [{**alt, "recent": (0, 4)} for alt in EvictionPolicy.FUZZ]

    recent: int = Int(0, low=0)  # the YAML sets 1
