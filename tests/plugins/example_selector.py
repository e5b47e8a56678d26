"""An example selector defined in one file (plus ``conf/policy/vnorm.yaml`` beside it): every generic test
(contract over every storage, fuzz, memory model, bad inputs, padded batches) picks it up with no other
change. It is a scorer (``kvcompress.selectors.eviction.scorer``): one ``score(step)`` method; when to
evict, budgets, ratios, thresholds, padding and the protected newest tokens are the base's.

Value-norm eviction, a toy for docs/extending.md and not a published method: a layer over its budget keeps,
per row and KV head, the tokens whose values have the largest L2 norm (their output weighs most when
attended), plus the ``recent`` newest. (The published key-norm rule, arXiv 2406.11430, is ``knorm``.)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.fields import Int
from kvcompress.selectors.eviction.scorer import ScorerPolicy


@dataclass
class VnormPolicy(ScorerPolicy):
    """Keep the ``budget`` (or ``1 - compression_ratio``) largest-norm values, plus the ``recent`` newest."""

    recent: int = Int(0, low=0)  # the YAML sets 1

    @property
    def protect(self) -> int:
        return self.recent

    def score(self, step):
        return step.values.float().norm(dim=-1)  # (B, H_kv, T)
