"""Block eviction: blocks of ``block_size`` tokens scored by the attention they receive; keep the best.

The block-granular form of score-based eviction (H2O's accumulated attention, Zhang et al., arXiv
2306.14048, aggregated over fixed blocks as Quest pages the cache, Tang et al., arXiv 2406.10774): what
is removed is always a whole contiguous span ``pos // block_size`` of the sequence.

``evict_at``: ``always`` (the default, H2O's: the accumulator is updated and a block evicted at decode steps
too) or ``prefill`` (steps of several tokens only; decode tokens are appended, unscored). A ``threshold`` is
refused: every KV head of a row holds the same number of blocks (``block_evict_layer``'s layout).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvcompress.core.fields import Choice, Float, Int
from kvcompress.core.policy import Policy, Shape
from kvcompress.selectors.eviction.base import check_one_budget
from kvcompress.selectors.eviction.block_evict_layer import BlockEvictLayer, _ceil_div
from kvcompress.selectors.eviction.when import EVICT_AT

SCORE_BYTES = 4  # one float32 score per stored block and KV head
COUNTER_BYTES = 8  # two int32 counters per batch row (real tokens, stored blocks)


@dataclass
class BlockEvictPolicy(Policy):
    """Keep the blocks that received the most attention, plus the blocks holding the sinks and the recent
    window; evict whole blocks only, at prefill down to the target and during decode one block at a time.

    A block's score is the attention its tokens received, summed over the query heads' mean of each KV
    group, accumulated over the last ``observation_window`` queries of every prefill step and, with
    ``evict_at: always`` (the default), every decode query (H2O's accumulator, kept per block; with
    ``prefill`` decode steps score and evict nothing). Every evictable block is complete (only the newest
    block is partial, and it is protected), so the sum and the mean per token rank blocks identically; we
    keep the sum, one float per block. Each row and KV head chooses its own blocks, the same number of them.

    The target is ``budget`` tokens per layer and KV head, or ``1 - compression_ratio`` of the real tokens
    seen (rounded down). Kept tokens are whole blocks, so a layer holds the protected blocks plus as many
    scored blocks as fit under the target: never more than the target, up to ``block_size - 1`` less.

    Args:
        block_size: tokens per block; block ``b`` is the span ``[b * block_size, (b + 1) * block_size)``.
        budget: tokens kept per layer and KV head (set exactly one of budget / compression_ratio).
        compression_ratio: fraction of the real tokens seen that is removed, in [0, 1).
        sink_tokens: the first tokens; the blocks holding them are never evicted.
        recent: the newest tokens; the blocks holding them (and always the newest block) are never evicted.
        observation_window: prompt queries of each prefill step whose attention is added to the scores.
        evict_at: always (H2O's, whose accumulator this is: decode queries add to the scores and a decode
            step over the target evicts a block); prefill: steps of several tokens only, decode tokens are
            appended and score nothing.
        threshold: refused (null only): a threshold keeps a different number of blocks in each KV head, and
            every head of a row holds the same number here (one block count per row; a head's valid slot
            ``i`` is in block ``i // block_size``), not the flat per-head layout a threshold is stored in.
    """

    layer_class = BlockEvictLayer
    FORMULA = True  # the memory formulas below are this class's own
    # evict_at=prefill over one-token steps never evicts: full plus a float32 score per block and head (3.1%
    # of K+V at block_size 1 and D=16) and the per-row counters, which on a 2-token stream make 6.2%
    MAX_MEMORY_RATIO = 1.07
    TEST_PARAMS = {"block_size": 4, "budget": 16, "compression_ratio": None, "sink_tokens": 2, "recent": 4,
                   "observation_window": 4}  # fmt: skip
    FUZZ = [
        {**alt, "block_size": (1, 8), "sink_tokens": (0, 6), "recent": (0, 10), "observation_window": (1, 8),
         "evict_at": list(EVICT_AT)}
        for alt in (
            {"budget": (1, 60), "compression_ratio": None},
            {"budget": None, "compression_ratio": [0.0, 0.5, 0.9]},
        )
    ]  # fmt: skip
    MEMORY_VARIANTS = [
        {"block_size": 16, "compression_ratio": 0.5, "sink_tokens": 4, "recent": 32},
        {"block_size": 8, "budget": 100, "compression_ratio": None, "sink_tokens": 0, "recent": 5},
        {"block_size": 8, "compression_ratio": 0.5, "sink_tokens": 4, "recent": 16, "evict_at": "prefill"},
    ]

    block_size: int = Int(32, low=1)
    budget: int | None = Int(None, low=1, null=True)
    compression_ratio: float | None = Float(None, 0.0, 1.0, high_open=True, null=True)
    sink_tokens: int = Int(4, low=0)
    recent: int = Int(64, low=0)
    observation_window: int = Int(32, low=1)
    evict_at: str = Choice("always", EVICT_AT)
    threshold: float | None = Choice(None, (None,))  # declared to be refused by name (``__post_init__``)
    sizes_served = ("budget", "compression_ratio")  # what ``when.check_one_budget`` offers

    def __post_init__(self):
        if self.threshold is not None:
            raise ValueError(
                f"block_evict.threshold={self.threshold!r} is not served: a threshold keeps a different "
                "number of blocks in each KV head, and block_evict's layout holds the same number in every "
                "head of a row (one block count per row; a head's valid slot i is in block i // block_size), "
                "not the flat per-head layout a threshold is stored in; use budget or compression_ratio (a "
                "threshold over accumulated attention per token: h2o.threshold); allowed: [None]"
            )
        super().__post_init__()
        check_one_budget(self)
        if self.budget is not None and self.budget < self.min_budget:
            raise ValueError(
                f"block_evict.budget={self.budget} is below {self.min_budget} = (sink blocks "
                f"{self.sink_blocks} + recent blocks {math.ceil(self.recent / self.block_size)} + 1) x "
                f"block_size={self.block_size}: the blocks holding sink_tokens={self.sink_tokens} and the "
                f"recent={self.recent} window are always kept, plus at least one block"
            )

    @property
    def evicts(self) -> str:
        return self.evict_at

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
        return max(1, int(n_tokens * (1.0 - self.compression_ratio) + 1e-9))

    def covering(self, n_tokens: int) -> BlockEvictPolicy:
        out = super().covering(n_tokens)
        if self.budget is not None:
            return dataclasses.replace(out, budget=max(self.budget, n_tokens))
        return dataclasses.replace(out, compression_ratio=0.0)

    # -- memory formula: how many whole blocks survive does not depend on scores ---------------
    def _replay(self, s: Shape) -> tuple[int, int]:
        """(stored tokens, stored blocks) after the prefill and each decode step, replaying the layer."""
        seen = stored = blocks = 0
        for q in [s.prefill] + [1] * s.decode:
            blocks += _ceil_div(seen + q, self.block_size) - _ceil_div(seen, self.block_size)
            stored, seen = stored + q, seen + q
            if q > 1 or self.evict_at == "always":  # with prefill a decode token is appended
                stored, blocks = self._after_eviction(seen, stored, blocks)
        return stored, blocks

    def _after_eviction(self, seen: int, stored: int, blocks: int) -> tuple[int, int]:
        bs, target = self.block_size, self.keep_count(seen)
        if stored <= target:
            return stored, blocks
        produced = _ceil_div(seen, bs)
        sinks = min(produced, self.sink_blocks)
        first_recent = max(seen - max(self.recent, 1), 0) // bs  # the newest block is always kept
        tail = max(produced - max(first_recent, sinks), 0)
        evictable = blocks - sinks - tail
        keep = min(max((target - (stored - evictable * bs)) // bs, 0), evictable)
        return stored - (evictable - keep) * bs, sinks + tail + keep

    def kept_tokens(self, s: Shape) -> int:
        return self._replay(s)[0]

    def state_bytes(self, s: Shape, kept: int) -> int:
        """A float32 score per stored block and KV head, two int32 counters per row."""
        return SCORE_BYTES * s.batch * s.kv_heads * self._replay(s)[1] + COUNTER_BYTES * s.batch
