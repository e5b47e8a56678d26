"""Block eviction: blocks of ``block_size`` tokens scored by the attention they receive; keep the best.

The block-granular form of score-based eviction (H2O's accumulated attention, Zhang et al., arXiv
2306.14048, aggregated over fixed blocks as Quest pages the cache, Tang et al., arXiv 2406.10774): what
is removed is always a whole contiguous span ``pos // block_size`` of the sequence.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvcompress.policies.base import ModelSpec, Policy
from kvcompress.policies.block_evict_layer import BlockEvictLayer


@dataclass
class BlockEvictPolicy(Policy):
    """Keep the blocks that received the most attention, plus the blocks holding the sinks and the recent
    window; evict whole blocks only, at prefill down to the target and during decode one block at a time.

    A block's score is the attention its tokens received, summed over the query heads' mean of each KV
    group, accumulated over the last ``window`` queries of every prefill step and every decode query
    (H2O's accumulator, kept per block). Every evictable block is complete (only the newest block is
    partial, and it is protected), so the sum and the mean per token rank blocks identically; we keep the
    sum, one float per block. Each row and KV head chooses its own blocks.

    The target is ``budget`` tokens per layer and KV head, or ``keep_ratio`` of the real tokens seen
    (rounded down). Kept tokens are whole blocks, so a layer holds the protected blocks plus as many
    scored blocks as fit under the target: never more than the target, up to ``block_size - 1`` less.

    Args:
        block_size: tokens per block; block ``b`` is the span ``[b * block_size, (b + 1) * block_size)``.
        budget: tokens kept per layer and KV head (set exactly one of budget / keep_ratio).
        keep_ratio: fraction of the real tokens seen that is kept, in (0, 1].
        sink_tokens: the first tokens; the blocks holding them are never evicted.
        recent: the newest tokens; the blocks holding them (and always the newest block) are never evicted.
        window: prompt queries of each prefill step whose attention is added to the block scores.
    """

    block_size: int = 32
    budget: int | None = None
    keep_ratio: float | None = 0.5
    sink_tokens: int = 4
    recent: int = 64
    window: int = 32

    def __post_init__(self):
        self.require_ints(block_size=1, sink_tokens=0, recent=0, window=1)
        if (self.budget is None) == (self.keep_ratio is None):
            raise ValueError(
                "block_evict: set exactly one of budget (tokens kept per layer and KV head) or keep_ratio "
                f"(fraction kept, in (0, 1]); got budget={self.budget}, keep_ratio={self.keep_ratio}"
            )
        if self.keep_ratio is not None and not (
            isinstance(self.keep_ratio, (int, float)) and 0.0 < self.keep_ratio <= 1.0
        ):
            raise ValueError(f"block_evict.keep_ratio={self.keep_ratio!r} must be in (0, 1] or null")
        if self.budget is not None:
            self._check_budget()

    def _check_budget(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int):
            raise ValueError(f"block_evict.budget={self.budget!r} must be an integer or null")
        if self.budget < self.min_budget:
            raise ValueError(
                f"block_evict.budget={self.budget} is below {self.min_budget} = (sink blocks "
                f"{self.sink_blocks} + recent blocks {math.ceil(self.recent / self.block_size)} + 1) x "
                f"block_size={self.block_size}: the blocks holding sink_tokens={self.sink_tokens} and the "
                f"recent={self.recent} window are always kept, plus at least one block"
            )

    @property
    def name(self) -> str:
        return "block_evict"

    @property
    def sink_blocks(self) -> int:
        """Blocks that hold the sink tokens."""
        return math.ceil(self.sink_tokens / self.block_size)

    @property
    def min_budget(self) -> int:
        """The most tokens the protected blocks can hold, rounded up to whole blocks."""
        return (self.sink_blocks + math.ceil(self.recent / self.block_size) + 1) * self.block_size

    def keep_count(self, n_tokens: int) -> int:
        """Target tokens per head after ``n_tokens`` real tokens (kept tokens are whole blocks under it)."""
        if self.budget is not None:
            return self.budget
        return max(1, int(n_tokens * self.keep_ratio + 1e-9))

    def covering(self, n_tokens: int) -> BlockEvictPolicy:
        if self.budget is not None:
            return dataclasses.replace(self, budget=max(self.budget, n_tokens))
        return dataclasses.replace(self, keep_ratio=1.0)

    def layer(self, layer_idx: int, spec: ModelSpec) -> BlockEvictLayer:
        return BlockEvictLayer(self, layer_idx, spec)
