"""The cache layer of ``TieredPolicy``: Quest page selection over an ``offload`` store's cold pages.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774.
"""

from __future__ import annotations

import math

import torch

from kvcompress.core.policy import PolicyLayer
from kvcompress.selectors.pages.block_sparse import pages_to_read, pages_to_read_count
from kvcompress.selectors.pages.block_sparse_layer import page_bounds


class TieredLayer(PolicyLayer):
    """Every step's queries read the hot tokens plus the cold pages with the highest Quest bound, per KV
    head (the bound is the max over the GQA group's query heads and over the step's queries), sinks always.
    ``update`` returns the hot tokens; ``attend`` adds the fetched pages; ``end_step`` (after attention)
    lets the store move pages that left the recent window to the cold tier."""

    wants_scores = True  # end_step after attention: this step's queries still read its whole chunk
    contiguous = True  # nothing is evicted: stored slot = cache position
    pads_exactly = False  # pages and the recent window are cut on batch slots, not on each row's tokens
    reads_as_stored = False  # its step selects what is read (``compress``/``attend``)

    def __init__(self, policy, layer_idx, spec, store):
        super().__init__(policy, layer_idx, spec, store)
        self.prefill_chunk = policy.prefill_chunk  # read by kvcompress.runtime.context_pass.forward_prompt

    def step(self, key_states, value_states, positions=None, forward=None):
        """As every layer; and notes, for this step's attention, the next layer's store when it is a tiered
        layer's too (its LRU receives the pages this layer fetches: a prefetch)."""
        self._ahead = self._next_store(forward)
        return super().step(key_states, value_states, positions, forward)

    def pass_refusal(self) -> str | None:
        """A context pass reads what a layer holds densely (``runtime.context_pass``): not cold pages."""
        if self.store.cold_pages:
            return (
                f"tiered holds {self.store.cold_pages} cold pages, which a context pass (kvzip in the same "
                "schedule) would not read; give the tiered layers a recent window that covers the context"
            )
        return super().pass_refusal()

    def _next_store(self, state):
        cache = getattr(state, "cache", None)
        layers = getattr(cache, "layers", ())
        nxt = layers[self.layer_idx + 1] if self.layer_idx + 1 < len(layers) else None
        return nxt.store if isinstance(nxt, TieredLayer) and self.store.prefetches else None

    def attend(self, query, key, value):
        """Pages (B, H_kv, k * block_size, D) then hot tokens, and a boolean mask (B, H_kv, q, T), or no mask
        for an unpadded decode step (every slot read is real, and SDPA keeps GQA without a mask)."""
        total, valid, _ = self._view
        self._view = (total, None, None)
        q, bs = query.shape[2], self.store.config.block_size
        pages = self.select(query) if self.store.cold_pages else None
        ok = None
        if q > 1 or valid is not None or self.window is not None:  # unpadded decode: no -1 page slots
            qpos = (self.seen - q + torch.arange(q, device=self.device)).view(1, 1, q, 1)
            first = self.store.cold_pages * bs  # slot of the first hot token
            kpos = torch.arange(first, first + total, device=self.device).view(1, 1, 1, -1)
            ok = self._allowed(kpos, qpos, None if valid is None else valid[:, :, None, first:])
            if pages is not None:
                page_ok = self._pages_allowed(pages, qpos, valid)
                ok = torch.cat([page_ok, ok.expand(*page_ok.shape[:2], -1, -1)], dim=-1)
        # the page slots fetched (every head reads as many without padding; with it, unused slots count too)
        self.count_read(total if pages is None else total + pages.shape[-1] * bs)
        if self.probe is not None:  # a probe watches (``PolicyLayer.watch``): positions of what is read
            self.read_pos = self._read_positions(pages, total)
        if pages is not None:
            page_k, page_v = self.store.fetch(pages, getattr(self, "_ahead", None))  # (B, H_kv, k * bs, D)
            key, value = torch.cat([page_k, key], dim=2), torch.cat([page_v, value], dim=2)
        self._ahead = None
        if ok is None:
            return key, value, None
        return key, value, ok | ~ok.any(-1, keepdim=True)  # padding queries: no all-masked row (NaN)

    def _read_positions(self, pages, total: int) -> torch.Tensor:
        """Positions (1 or B, 1 or H_kv, n) of the keys ``attend`` returns: the fetched pages' tokens (-1 in
        an unused page slot), then the ``total`` hot tokens (stored slot = cache position: no eviction)."""
        bs = self.store.config.block_size
        first = self.store.cold_pages * bs  # slot of the first hot token
        hot = torch.arange(first, first + total, device=self.device).view(1, 1, -1)
        if pages is None:
            return hot
        t = (pages[..., None] * bs + torch.arange(bs, device=self.device)).masked_fill(
            pages[..., None] < 0, -1
        )
        return torch.cat([t.flatten(2), hot.expand(*pages.shape[:2], -1)], dim=-1)

    def _pages_allowed(self, pages, qpos, valid) -> torch.Tensor:
        """Which tokens of the fetched ``pages`` (B, H_kv, k) each query may read: (B, H_kv, q, k * bs)."""
        bs = self.store.config.block_size
        t = (pages[..., None] * bs + torch.arange(bs, device=self.device)).flatten(2)  # (B, H_kv, k*bs)
        real = None if valid is None else valid.expand(-1, t.shape[1], -1).gather(-1, t.clamp(min=0))
        seen = (pages >= 0).repeat_interleave(bs, dim=-1)
        real = seen if real is None else seen & real
        return self._allowed(t[:, :, None, :], qpos, real[:, :, None, :])

    def _allowed(self, kpos, qpos, real):
        """Causal by cache position, within the model's own window, never on padding: (B or 1, h, q, T)."""
        ok = kpos <= qpos
        if self.window is not None:
            ok = ok & self._window_mask(kpos, qpos)
        return ok if real is None else ok & real

    def select(self, query: torch.Tensor) -> torch.Tensor | None:
        """Cold pages (B, H_kv, k) this step reads, -1 for unused slots; None when none is to be read."""
        lo, hi = self.store.summaries(query.dtype)
        score = page_bounds(lo, hi, query)  # (B, H_kv, P)
        real = score > -math.inf  # pages holding a real token
        forced = real & (real.cumsum(-1) <= self.policy.sink_blocks)
        p = self.policy
        k = pages_to_read(real.sum(-1), p.top_k_blocks, p.read_ratio, max(1, p.sink_blocks))
        k = k.clamp(max=self.store.config.lru_pages)  # the device budget caps a read_ratio
        kmax = self._widest(score.shape[-1])  # on the host: no row reads more; unused slots are -1
        if kmax == 0:
            return None
        top = score.masked_fill(forced, math.inf).topk(kmax, dim=-1).indices
        return top.masked_fill(torch.arange(kmax, device=self.device) >= k[..., None], -1)

    def _widest(self, n_pages: int) -> int:
        """Pages the fullest row may read, from the cold page count alone (host integers, the same rule)."""
        p = self.policy
        k = pages_to_read_count(n_pages, p.top_k_blocks, p.read_ratio, max(1, p.sink_blocks))
        return min(k, self.store.config.lru_pages)

    def stats(self) -> dict:
        s = super().stats()
        s["bytes"] = s["device_bytes"] = self.memory_bytes()  # the device tier (cold pages: host/disk_bytes)
        ratio, cap = self.policy.read_ratio, self.store.config.lru_pages
        wanted = math.ceil(ratio * self.store.cold_pages) if ratio is not None else 0
        s["read_ratio_capped"] = wanted > cap  # read_ratio asked for more pages than the device LRU holds
        return s
