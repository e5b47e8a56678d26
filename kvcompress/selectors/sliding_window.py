"""StreamingLLM: attention sinks plus a sliding window of recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvcompress.core.fields import Int
from kvcompress.core.policy import Policy, Shape
from kvcompress.selectors.window_layer import SlidingWindowLayer


@dataclass
class SlidingWindowPolicy(Policy):
    """Keep the first ``sink_tokens`` real tokens and the last ``window`` tokens; evict the rest."""

    layer_class = SlidingWindowLayer
    FORMULA = True  # the memory formulas below are this class's own
    evicts = "always"
    heads_share_tokens = True  # every KV head keeps the same tokens (shared low-rank latents can follow)
    TEST_PARAMS = {"sink_tokens": 2, "window": 12}
    FUZZ = {"sink_tokens": (0, 6), "window": (1, 24)}
    MEMORY_VARIANTS = [{"sink_tokens": 4, "window": 300}]

    sink_tokens: int = Int(4, low=0)
    window: int = Int(252, low=1)

    @property
    def budget(self) -> int:
        return self.sink_tokens + self.window

    def covering(self, n_tokens: int) -> SlidingWindowPolicy:
        return dataclasses.replace(super().covering(n_tokens), window=max(self.window, n_tokens))

    def kept_tokens(self, s: Shape) -> int:
        """Sinks plus window: ``min(T, sink_tokens + window)``."""
        return min(s.total, self.budget)
