"""Formula of block eviction (``block_evict``): how many whole blocks survive does not depend on scores.

The layer replays ``BlockEvictLayer``'s arithmetic: after each forward (the prefill, then one token per
decode step) it holds the protected blocks (those with the sink tokens, the recent window and the newest
block) plus as many complete evictable blocks as fit under the target, evicting only when the stored
tokens exceed it.
"""

from __future__ import annotations

from kvcompress.memory_model.core import Shape, formula
from kvcompress.policies.block_evict import BlockEvictPolicy

SCORE_BYTES = 4  # one float32 score per stored block and KV head
COUNTER_BYTES = 8  # two int32 counters per batch row (real tokens, stored blocks)


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


def _after_eviction(p: BlockEvictPolicy, seen: int, stored: int, blocks: int) -> tuple[int, int]:
    """(stored tokens, stored blocks) once a forward that brought the layer to ``seen`` tokens evicted."""
    bs, target = p.block_size, p.keep_count(seen)
    if stored <= target:
        return stored, blocks
    produced = _ceil(seen, bs)
    sinks = min(produced, p.sink_blocks)
    first_recent = max(seen - max(p.recent, 1), 0) // bs  # the newest block is always kept
    tail = max(produced - max(first_recent, sinks), 0)
    evictable = blocks - sinks - tail
    keep = min(max((target - (stored - evictable * bs)) // bs, 0), evictable)
    return stored - (evictable - keep) * bs, sinks + tail + keep


@formula(BlockEvictPolicy)
def _block_evict(p: BlockEvictPolicy, s: Shape) -> int:
    """``kv(stored) + 4 * B * H_kv * blocks + 8 * B`` after replaying every forward's block arithmetic."""
    seen = stored = blocks = 0
    for q in [s.prefill] + [1] * s.decode:
        blocks += _ceil(seen + q, p.block_size) - _ceil(seen, p.block_size)
        stored, seen = stored + q, seen + q
        stored, blocks = _after_eviction(p, seen, stored, blocks)
    return s.kv(stored) + SCORE_BYTES * s.batch * s.kv_heads * blocks + COUNTER_BYTES * s.batch
