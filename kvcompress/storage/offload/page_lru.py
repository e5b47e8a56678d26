"""The device tier's cache of fetched pages: per row and KV head, the least recently used page leaves first.

Slots ``(B, H_kv, S)`` hold whole pages (keys and values of ``block_size`` tokens, one row each); a step
asks for pages ``(B, H_kv, k)`` with ``k <= S``, the hits are reused, the misses are fetched from the cold
tier into the slots that no page of this step uses, oldest first. Capacity grows with the cold pages up to
the budget (a short sequence never holds more slots than it has cold pages). The state is a named tuple
of tensors, so it moves with beam reorders and snapshots like any other per-row tensor of a store.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

NEVER = -1


class LRU(NamedTuple):
    rows: torch.Tensor  # (B * H_kv * S, 2 * block_size * D) pages' keys then values
    page: torch.Tensor  # (B, H_kv, S) int64 page id, -1 empty
    used: torch.Tensor  # (B, H_kv, S) int64 lookup of last use, -1 never


def grow(lru: LRU | None, b: int, h: int, n: int, row: int, dtype, device) -> LRU:
    """``lru`` with ``n`` slots per row and head (its pages kept), or as it is when it has as many."""
    have = 0 if lru is None else lru.page.shape[-1]
    if n <= have:
        return lru
    rows = torch.zeros(b, h, n, row, dtype=dtype, device=device)
    page = torch.full((b, h, n), -1, dtype=torch.long, device=device)
    used = torch.full((b, h, n), NEVER, dtype=torch.long, device=device)
    if lru is not None:
        rows[:, :, :have] = lru.rows.view(b, h, have, row)
        page[:, :, :have], used[:, :, :have] = lru.page, lru.used
    return LRU(rows.view(b * h * n, row), page, used)


def lookup(lru: LRU, want: torch.Tensor, fetch, counters: dict, ahead=None) -> torch.Tensor:
    """Rows (B, H_kv, k, row) of pages ``want`` (B, H_kv, k) (-1: none; its rows are unspecified); misses
    are copied in by ``fetch(triples, slots)``: the misses' (b, h, page) as host int64 arrays and their
    flat slots (m,) on the host; it writes their rows into ``lru.rows`` and their ids into ``lru.page``.

    The host reads one thing per call: which pages miss, and where they go (``tolist`` of one small
    tensor). Victims are chosen on the device for every asked page, hit or not, so nothing else waits.
    ``counters`` gains ``lookups``, ``hits``, ``pages_fetched``; its ``tick`` orders the uses.

    ``ahead``: ``(lru, fetch, counters)`` of the next layer, which will likely ask for the same pages: its
    misses among ``want`` are fetched now too (a prefetch), found in the same read, counted in its
    ``pages_prefetched`` and marked as used at its current tick.
    """
    b, h, k = want.shape
    s = lru.page.shape[-1]
    if k > s:
        raise ValueError(f"offload: {k} pages asked in one step, but the device holds only {s} fetched pages")
    asked = want >= 0
    need, slot = _plan(lru, want, asked)
    parts = [want, need.long(), slot]
    if ahead is not None:
        need_next, slot_next = _plan(ahead[0], want, asked)
        parts += [need_next.long(), slot_next]
    misses = np.array(torch.stack(parts).tolist(), dtype=np.int64)  # the one read of this layer-step
    n = _fill(misses[0], misses[1], misses[2], h, s, fetch)  # writes lru.rows and lru.page
    counters["pages_fetched"] += n
    if ahead is not None:
        nxt, fetch_next, counters_next = ahead
        done = _fill(misses[0], misses[3], misses[4], h, s, fetch_next)
        counters_next["pages_prefetched"] = counters_next.get("pages_prefetched", 0) + done
        fresh = torch.zeros_like(nxt.used).scatter_reduce_(-1, slot_next, need_next.long(), "amax") > 0
        nxt.used.masked_fill_(fresh, counters_next["tick"])
    counters["tick"] += 1
    touched = torch.zeros_like(lru.used).scatter_reduce_(-1, slot, asked.long(), "amax") > 0
    lru.used.masked_fill_(touched, counters["tick"])
    n_asked = int((misses[0] >= 0).sum())
    counters["lookups"] += n_asked
    counters["hits"] += n_asked - n
    index = (torch.arange(b * h, device=want.device).view(b, h, 1) * s + slot).view(-1)
    return lru.rows.index_select(0, index).view(b, h, k, -1)


def _plan(lru: LRU, want: torch.Tensor, asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: which asked pages miss (B, H_kv, k) and the slot each asked page will sit in (its
    own on a hit; on a miss, empty slots first, then the least recently used not asked this step)."""
    hit = (lru.page[:, :, None, :] == want[..., None]) & asked[..., None]  # (B, H_kv, k, S)
    need = asked & ~hit.any(-1)
    age = lru.used.masked_fill(hit.any(-2), torch.iinfo(torch.long).max)  # this step's pages stay
    order = age.argsort(dim=-1, stable=True)  # (B, H_kv, S): empty, then least recently used first
    rank = (need.long().cumsum(-1) - 1).clamp(min=0)
    return need, torch.where(need, order.gather(-1, rank), hit.int().argmax(-1))


def _fill(want, need, slot, h: int, s: int, fetch) -> int:
    """Fetch the pages that miss (host arrays (B, H_kv, k)) into their slots; returns how many."""
    bi, hi, ki = np.nonzero(need)
    if bi.size:
        fetch((bi, hi, want[bi, hi, ki]), (bi * h + hi) * s + slot[bi, hi, ki])
    return int(bi.size)


def reorder(lru: LRU | None, beam_idx: torch.Tensor) -> LRU | None:
    """Rows of the batch in ``beam_idx`` order (beam search)."""
    if lru is None:
        return None
    b, h, s = lru.page.shape
    rows = lru.rows.view(b, h * s, -1).index_select(0, beam_idx).reshape(b * h * s, -1)
    return LRU(rows, lru.page.index_select(0, beam_idx), lru.used.index_select(0, beam_idx))
