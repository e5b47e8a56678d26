"""Per-block attention scores and whole-block eviction: the cache layer of ``BlockEvictPolicy``.

Layout invariant, per batch row and KV head: the valid (non-padding) slots, in order, are the stored
blocks in ascending order, each complete (``block_size`` tokens) except the newest. Valid slot ``i``
therefore belongs to stored block ``i // block_size``, so no per-token position is stored. The sink
blocks open that list and the recent blocks close it (they were never evicted); the blocks between are
the evictable ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvcompress.selectors.eviction.base import EvictionLayer


def _ceil_div(n: torch.Tensor | int, d: int) -> torch.Tensor | int:
    return (n + d - 1) // d


class BlockEvictLayer(EvictionLayer):
    """Dense storage plus ``block_scores`` (B, H_kv, NB) float32, the attention each stored block
    received, and per-row counters ``n_real`` (real tokens consumed) and ``n_blocks`` (blocks stored),
    both (B,) int32. ``rows`` mirrors on the host, per row, (real tokens consumed, blocks stored, real
    tokens stored): every count these imply (what to evict, how many tokens stay) is decided from it, so
    a decode step reads nothing back from the device (a padded forward reads its new tokens' counts once)."""

    per_row = (*EvictionLayer.per_row, "block_scores", "n_real", "n_blocks")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: tuple[tuple[int, int, int], ...] = ()  # per row: real tokens, blocks, real tokens stored

    def stats(self) -> dict:
        blocks = max((r[1] for r in self.rows), default=0)
        return {**super().stats(), "block_size": self.policy.block_size, "blocks_stored": blocks}

    def reset(self) -> None:
        super().reset()
        self.rows = ()

    def reorder_cache(self, beam_idx) -> None:
        super().reorder_cache(beam_idx)
        if len(set(self.rows)) > 1:  # rows differ (padding): the host mirror follows the beams
            self.rows = tuple(self.rows[i] for i in beam_idx.tolist())
        elif self.rows:
            self.rows = (self.rows[0],) * beam_idx.shape[0]

    # -- storage ------------------------------------------------------------------------------
    def on_append(self, key_states, new_valid) -> None:
        super().on_append(key_states, new_valid)
        b, h, q, _ = key_states.shape
        if self.n_real is None:
            self.n_real = torch.zeros(b, dtype=torch.int32, device=key_states.device)
            self.n_blocks = torch.zeros_like(self.n_real)
            self.block_scores = torch.zeros(b, h, 0, dtype=torch.float32, device=key_states.device)
        bs = self.policy.block_size
        if not self.rows:
            self.rows = ((0, 0, 0),) * b
        if new_valid is None and self.valid is None:  # no padding: n_real == seen, plain integer updates
            opened = _ceil_div(self.seen + q, bs) - _ceil_div(self.seen, bs)  # blocks this step opens
            self.n_real = self.n_real + q
            self.n_blocks = self.n_blocks + opened if opened else self.n_blocks
            counts = [q] * b
        else:
            count = (
                torch.full_like(self.n_real, q) if new_valid is None else new_valid.sum(-1, dtype=torch.int32)
            )
            self.n_blocks = self.n_blocks + _ceil_div(self.n_real + count, bs) - _ceil_div(self.n_real, bs)
            self.n_real = self.n_real + count
            counts = [q] * b if new_valid is None else count.tolist()  # a padded forward: read once
        self.rows = tuple(
            (real + c, blocks + _ceil_div(real + c, bs) - _ceil_div(real, bs), stored + c)
            for (real, blocks, stored), c in zip(self.rows, counts, strict=True)
        )
        grow = max(r[1] for r in self.rows) - self.block_scores.shape[-1]
        if grow > 0:  # new blocks start at 0; unused entries of shorter rows are 0 too
            self.block_scores = F.pad(self.block_scores, (0, grow))

    def _slot_blocks(self) -> torch.Tensor:
        """Stored-block index (B, 1 or H_kv, T) of every slot (padding slots: a neighbour's; they score 0)."""
        bs = self.policy.block_size
        if self.valid is None:
            t = torch.arange(self.stored_length(), device=self.device) // bs
            return t[None, None].expand(self.n_real.shape[0], 1, -1)
        return (self.valid.cumsum(-1) - 1).clamp(min=0) // bs

    # -- scoring and eviction -----------------------------------------------------------------
    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        if self.block_scores.shape[-1] == 0:  # only padding so far
            return
        received = self.scores(query, key, scaling, self.policy.observation_window, probs).sum(dim=2)
        self._add_block_scores(received)
        if self.valid is None and self.stored_length() <= self.policy.keep_count(self.seen):
            return  # under the target nothing can be evicted (most decode steps): skip the block arithmetic
        self._evict()

    def _add_block_scores(self, received: torch.Tensor) -> None:
        """Add each slot's received attention (B, H_kv, T) to its block's score."""
        b, h, t = received.shape
        bs, nb = self.policy.block_size, self.block_scores.shape[-1]
        if self.valid is None and nb == _ceil_div(t, bs):  # slots in block order: sum whole blocks, no index
            self.block_scores += F.pad(received, (0, nb * bs - t)).view(b, h, nb, bs).sum(-1)
            return
        self.block_scores.scatter_add_(-1, self._slot_blocks().expand_as(received), received)

    def _protected(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row (B,): how many stored blocks open the list as sinks and close it as the recent window."""
        p, bs = self.policy, self.policy.block_size
        produced = _ceil_div(self.n_real, bs)
        sinks = produced.clamp(max=p.sink_blocks)
        first_recent = (self.n_real - max(p.recent, 1)).clamp(min=0) // bs  # the newest block always
        return sinks, (produced - torch.maximum(first_recent, sinks)).clamp(min=0)

    def _targets(self) -> torch.Tensor:
        """Target tokens per row (B,): the budget, or ``1 - compression_ratio`` of the row's real tokens."""
        if self.policy.budget is not None:
            return torch.full_like(self.n_real, self.policy.budget)
        return (
            (self.n_real.double() * (1.0 - self.policy.compression_ratio) + 1e-9).floor().long().clamp(min=1)
        )

    def _evict(self) -> None:
        """Evict whole blocks in rows whose evictable blocks no longer fit under the target."""
        plan = [self._row_plan(*row) for row in self.rows]  # per row: (evictable, keep_n, tokens kept)
        if all(keep == evictable for evictable, keep, _ in plan):
            return
        sinks, tail = self._protected()
        evictable = self.n_blocks - sinks - tail  # (B,) complete blocks, bs tokens each
        stored = self._stored_real()
        fit = (self._targets() - (stored - evictable * self.policy.block_size)) // self.policy.block_size
        keep_n = torch.minimum(fit.clamp(min=0), evictable)
        keep_block = self._choose(sinks, tail, keep_n)  # (B, H_kv, NB)
        kept = keep_block.gather(-1, self._slot_blocks().expand(-1, keep_block.shape[1], -1))
        if self.valid is not None:
            kept &= self.valid
        k = max(n for _, _, n in plan)
        idx = self.select(kept.float(), k)  # (B, H_kv, k): copies, frees storage
        if any(n != k for _, _, n in plan):  # rows keeping fewer tokens than the fullest: extra slots padding
            kept = kept.gather(-1, idx)
            self.valid = kept if self.valid is None else self.valid & kept
        removed = [evictable - keep for evictable, keep, _ in plan]
        self.rows = tuple(
            (real, blocks - r, stored - r * self.policy.block_size)
            for (real, blocks, stored), r in zip(self.rows, removed, strict=True)
        )
        self._compact(keep_block)

    def _row_plan(self, real: int, blocks: int, stored: int) -> tuple[int, int, int]:
        """One row's eviction on the host, as ``_evict`` makes it on the device: its evictable blocks, how
        many of them stay, and the real tokens it keeps."""
        p, bs = self.policy, self.policy.block_size
        produced = _ceil_div(real, bs)
        sinks = min(produced, p.sink_blocks)
        first_recent = max(real - max(p.recent, 1), 0) // bs
        tail = max(produced - max(first_recent, sinks), 0)
        evictable = blocks - sinks - tail
        if p.budget is not None:
            target = p.budget
        else:
            target = max(1, math.floor(real * (1.0 - p.compression_ratio) + 1e-9))
        keep = min(max((target - (stored - evictable * bs)) // bs, 0), evictable)
        return evictable, keep, stored - (evictable - keep) * bs

    def _stored_real(self) -> torch.Tensor:
        """Real tokens stored per row (B,) on the device: the same in every head."""
        if self.valid is None:
            return torch.full_like(self.n_real, self.stored_length())
        return self.valid[:, 0].sum(-1)

    def _choose(self, sinks, tail, keep_n) -> torch.Tensor:
        """Blocks kept (B, H_kv, NB): protected ones and, per head, the ``keep_n`` best-scoring others."""
        i = torch.arange(self.block_scores.shape[-1], device=self.device)
        n_blocks = self.n_blocks[:, None, None]
        evictable = (i >= sinks[:, None, None]) & (i < n_blocks - tail[:, None, None])  # (B, 1, NB)
        protected = (i < n_blocks) & ~evictable
        score = self.block_scores.masked_fill(~evictable, -math.inf)
        rank = score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0 = best
        return protected | (evictable & (rank < keep_n[:, None, None]))

    def _compact(self, keep_block: torch.Tensor) -> None:
        """Drop the scores of evicted blocks: kept blocks first, in order, unused entries 0 (a new tensor)."""
        order = (~keep_block).to(torch.int8).argsort(dim=-1, stable=True)
        n_kept = keep_block.sum(-1)  # (B, H_kv): the same in every head
        width = max(r[1] for r in self.rows)  # the host's count of the blocks the fullest row keeps
        scores = self.block_scores.gather(-1, order)[..., :width]
        unused = torch.arange(width, device=self.device) >= n_kept[..., None]
        self.block_scores = scores.masked_fill(unused, 0.0)
        self.n_blocks = n_kept[:, 0].to(torch.int32)
