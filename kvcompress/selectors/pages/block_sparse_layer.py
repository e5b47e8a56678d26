"""Quest page metadata and per-step page selection: the cache layer of ``BlockSparsePolicy``.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from kvcompress.core import kernel_slots
from kvcompress.core.buffers import gather_pages, gather_tokens
from kvcompress.core.plan import Pages
from kvcompress.core.policy import ModelSpec, PolicyLayer

if TYPE_CHECKING:
    from kvcompress.selectors.pages.block_sparse import BlockSparsePolicy


class BlockSparseLayer(PolicyLayer):
    """Full storage plus page key bounds ``page_min``/``page_max`` (B, H_kv, P, D); selects in ``attend``.

    Pages are aligned to each row's first real token (of the first forward), so left padding does not
    change which tokens share a page.
    """

    COUNTERS = (
        "decode_steps",
        "pages_read",
        "pages_total",
        "kv_bytes_read",
        "meta_bytes_read",
        "kv_bytes_full",
        "in_place_steps",  # decode steps whose pages were read where they lie (``fused_pages``)
    )

    per_row = ("page_min", "page_max")
    reads_as_stored = False  # its step selects what is read (``compress``/``attend``)

    def __init__(self, policy: BlockSparsePolicy, layer_idx: int, spec: ModelSpec, store):
        super().__init__(policy, layer_idx, spec, store)
        self.shift: list[int] | None = None  # per row: virtual positions before its first real token
        self.meta_len = 0  # stored tokens already summarised in the page bounds
        self._reads = None  # (pages, keys, values) of a step whose attention reads pages in place
        self.counters = dict.fromkeys(self.COUNTERS, 0)

    def reset(self) -> None:
        super().reset()
        self.shift, self._reads = None, None
        self.meta_len = 0
        self.counters = dict.fromkeys(self.COUNTERS, 0)

    def never_crops(self) -> str | None:
        return (
            "its page bounds (key min/max per page) already fold in the rejected tokens' keys, and a min or "
            "max cannot be unfolded"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.shift = [self.shift[i] for i in beam_idx.tolist()]

    # -- page metadata ------------------------------------------------------------------------
    def _page_of(self, t: torch.Tensor) -> torch.Tensor:
        """Page index (B, n) of stored positions ``t`` (n,)."""
        shift = _shift_tensor(tuple(self.shift), str(self.device))[:, None]
        return torch.div(t[None] + shift, self.policy.block_size, rounding_mode="floor")

    def compress(self, keys, values) -> None:
        """Fold the new tokens' keys into the per-page min/max (padding contributes nothing)."""
        start, total = self.meta_len, self.stored_length()
        if self.shift is None:
            b = keys.shape[0]
            first = self.valid[:, 0].int().argmax(-1).tolist() if self.valid is not None else [0] * b
            self.shift = [(-f) % self.policy.block_size for f in first]
        if self._fold_one(keys, start, total):
            return
        new = keys[:, :, start:]  # (B, H_kv, q, D)
        lo, hi = new, new
        if self.valid is not None:
            real = self.valid[:, :, start:, None]
            lo, hi = new.masked_fill(~real, math.inf), new.masked_fill(~real, -math.inf)
        n_pages = (total - 1 + max(self.shift)) // self.policy.block_size + 1
        self.page_min = _grow(self.page_min, new, n_pages, math.inf)
        self.page_max = _grow(self.page_max, new, n_pages, -math.inf)
        idx = self._page_of(torch.arange(start, total, device=self.device))[:, None, :, None]
        idx = idx.expand(-1, new.shape[1], -1, new.shape[-1])
        self.page_min.scatter_reduce_(2, idx, lo, "amin")
        self.page_max.scatter_reduce_(2, idx, hi, "amax")
        self.meta_len = total

    def _fold_one(self, keys: torch.Tensor, start: int, total: int) -> bool:
        """Fold one unpadded token into its page's bounds in place, two element-wise ops instead of a
        scatter over page indices (a decode step's case); False where the general path is needed."""
        if self.valid is not None or total - start != 1 or self.page_min is None or any(self.shift):
            return False
        page = (total - 1) // self.policy.block_size
        if page >= self.page_min.shape[2]:  # the token opens a page: grown by the general path
            return False
        new = keys[:, :, start]  # (B, H_kv, D)
        self.page_min[:, :, page].clamp_(max=new)
        self.page_max[:, :, page].clamp_(min=new)
        self.meta_len = total
        return True

    def page_bounds(self, query: torch.Tensor) -> torch.Tensor:
        """Upper bound of q·k over each page, max over the query heads of a GQA group: (B, H_kv, P)."""
        # without padding every page holds a token: no empty page to mask
        return page_bounds(self.page_min, self.page_max, query[:, :, None], self.valid is not None)

    # -- selection ----------------------------------------------------------------------------
    def attend(self, query, key, value):
        if query.shape[2] > 1 or self.page_min is None:
            return super().attend(query, key, value)
        self._view = (self._view[0], None, None)  # drop the transient references
        pages = self.select(query[:, :, 0])
        if self.valid is None and self.window is None:  # every read token is real: no mask at all
            self._count_unpadded(pages, key)
            if self.read_pos is None and self.policy.backend != "dense":
                self.deferred, self._reads = True, (pages, key, value)  # read in place if a backend can
                return key, value, None
            return self._attend_unpadded(pages, key, value)
        idx, ok = self._tokens(pages, key.shape[-2])
        if self.read_pos is not None:  # a probe watches: positions of the pages read
            self.read_pos = self.read_pos.expand(-1, idx.shape[1], -1).gather(-1, idx)
        if self.window is not None:  # never beyond the model's own window
            kpos = idx if self.pos is None else self.pos.expand(-1, idx.shape[1], -1).gather(-1, idx)
            ok = ok & self._window_mask(kpos, torch.full((), self.seen - 1, device=self.device))
        self._count(pages, ok, key)
        return gather_tokens(key, idx), gather_tokens(value, idx), ok[:, :, None, :]

    def select(self, query: torch.Tensor) -> torch.Tensor:
        """Pages this decode step reads, ascending, -1 for unused slots: (B, H_kv, k)."""
        if self.valid is None:  # no padding: every page holds tokens, the newest is the last one
            width = self.policy.pages_to_read_count(self.page_min.shape[2])
            pages = None
            if self.policy.backend != "dense":  # one kernel call where one is lent (C++, CPU)
                bounds = self.page_min, self.page_max, self.policy.sink_blocks, width
                pages = kernel_slots.first("select_pages", query, *bounds)
            return self._select_unpadded(self.page_bounds(query), width) if pages is None else pages
        score = self.page_bounds(query)
        real = score > -math.inf  # (B, H_kv, P) non-empty pages
        forced = real & (real.cumsum(-1) <= self.policy.sink_blocks)
        newest = self._page_of(torch.full((1,), self.stored_length() - 1, device=self.device))  # (B, 1)
        forced.scatter_(-1, newest[:, None].expand(-1, score.shape[1], -1), True)
        k = self.policy.pages_to_read(real.sum(-1))  # (B, H_kv)
        # rows differ in real pages with padding: the width is the count for every page, known on the host
        # (no row reads more); a row's unused slots are -1
        width = self.policy.pages_to_read_count(score.shape[-1])
        top = score.masked_fill(forced, math.inf).topk(width, dim=-1).indices  # best first
        top = top.masked_fill(torch.arange(top.shape[-1], device=self.device) >= k[..., None], -1)
        return top.sort(dim=-1).values

    def _select_unpadded(self, score: torch.Tensor, width: int) -> torch.Tensor:
        """``select``'s tensor form where every page is real: the same pages, with no per-page masks (the
        sinks and the newest page are forced by slicing, and the ``width`` is known on the host)."""
        score[..., : self.policy.sink_blocks] = math.inf
        score[..., -1] = math.inf
        return score.topk(width, dim=-1).indices.sort(dim=-1).values

    def _tokens(self, pages: torch.Tensor, total: int):
        """Token indices (B, H_kv, k * block_size) of ``pages`` and which of them are real."""
        bs = self.policy.block_size
        shift = _shift_tensor(tuple(self.shift), str(self.device))[:, None, None, None]
        t = (pages[..., None] * bs + torch.arange(bs, device=self.device) - shift).flatten(2)
        ok = (pages[..., None] >= 0).expand(-1, -1, -1, bs).flatten(2) & (t >= 0) & (t < total)
        t = t.clamp(0, total - 1)
        if self.valid is not None:
            ok &= self.valid.expand(-1, t.shape[1], -1).gather(-1, t)
        return t, ok

    def _count_unpadded(self, pages: torch.Tensor, key) -> None:
        """Counters of an unpadded step: whole pages, then the newest page's stored tokens."""
        (b, h_kv, total, _), bs = key.shape, self.policy.block_size
        per_head = (pages.shape[-1] - 1) * bs + total - self._newest_page_start(total)  # per row and head
        self._add_counts(key, pages.numel(), b * h_kv * self.page_max.shape[2], b * h_kv * per_head,
                         b * h_kv * total)  # fmt: skip

    def _attend_unpadded(self, pages: torch.Tensor, key, value):
        """Keys and values (B, H_kv, n, D) of ``pages`` without padding: whole pages copied page by page,
        then the newest page's stored tokens (a slice), so every token read is real and attention needs no
        mask (a mask would make SDPA repeat the KV heads for GQA)."""
        total, bs = key.shape[2], self.policy.block_size
        tail = self._newest_page_start(total)
        if self.read_pos is not None:  # a probe watches: positions of the tokens read
            idx = self._tokens_unpadded(pages, total)
            self.read_pos = self.read_pos.expand(-1, idx.shape[1], -1).gather(-1, idx)
        k = torch.cat([gather_pages(key, pages[..., :-1], bs), key[:, :, tail:total]], dim=2)
        v = torch.cat([gather_pages(value, pages[..., :-1], bs), value[:, :, tail:total]], dim=2)
        return k, v, None

    def compact_read(self) -> Pages:
        """The chosen pages, to be read where they lie (``kvcompress.kernels.fused_pages`` on a CPU)."""
        (pages, key, value), p = self._reads, self.policy
        return Pages(key, value, pages.contiguous(), p.block_size, key.shape[2], p.backend)

    def compact_done(self) -> None:
        self._reads, self.deferred = None, False
        self.counters["in_place_steps"] += 1

    def read_deferred(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen pages gathered, where the model's attention cannot be replaced (soft-capping)."""
        (pages, key, value), self._reads, self.deferred = self._reads, None, False
        k, v, _ = self._attend_unpadded(pages, key, value)
        return k, v

    def _tokens_unpadded(self, pages: torch.Tensor, total: int) -> torch.Tensor:
        """Token indices (B, H_kv, n) that ``_attend_unpadded`` reads: whole ``pages`` (ascending, the newest
        last, no -1), then only the stored tokens of the newest one."""
        bs = self.policy.block_size
        whole = (pages[..., :-1, None] * bs + torch.arange(bs, device=self.device)).flatten(2)
        tail = torch.arange(self._newest_page_start(total), total, device=self.device)
        return torch.cat([whole, tail.expand(*pages.shape[:2], -1)], dim=-1)

    def _newest_page_start(self, total: int) -> int:
        """First slot of the newest page when ``total`` tokens are stored without padding (shift 0)."""
        return (total - 1) // self.policy.block_size * self.policy.block_size

    def _count(self, pages: torch.Tensor, ok: torch.Tensor, key: torch.Tensor) -> None:
        """Add a padded step's reads to the counters, as device tensors (read on the host by ``stats``)."""
        b, h_kv, total, _ = key.shape
        n_pages = (self.page_max[..., 0] >= self.page_min[..., 0]).sum()
        real = b * total * h_kv if self.valid is None else self.valid.sum() * (h_kv // self.valid.shape[1])
        self._add_counts(key, (pages >= 0).sum(), n_pages, ok.sum(), real)

    def _add_counts(self, key: torch.Tensor, pages_read, pages_total, tokens_read, tokens_full) -> None:
        """One decode step's counts (ints, or device tensors where they depend on padding), in every row and
        KV head: pages read and existing, tokens (K and V) read and stored."""
        row_bytes = 2 * key.shape[-1] * key.element_size()  # one token of K and V, or one page min+max
        c = self.counters
        c["decode_steps"] += 1
        c["pages_read"] = c["pages_read"] + pages_read
        c["pages_total"] = c["pages_total"] + pages_total
        c["kv_bytes_read"] = c["kv_bytes_read"] + tokens_read * row_bytes
        c["meta_bytes_read"] = c["meta_bytes_read"] + pages_total * row_bytes
        c["kv_bytes_full"] = c["kv_bytes_full"] + tokens_full * row_bytes
        self.count_read(tokens_read / (key.shape[0] * key.shape[1]))  # per row and KV head

    def stats(self) -> dict:
        c = {k: int(v) for k, v in self.counters.items()}
        return {**super().stats(), **c, "pages_read_fraction": c["pages_read"] / max(c["pages_total"], 1)}


@functools.lru_cache(maxsize=64)
def _shift_tensor(shift: tuple[int, ...], device: str) -> torch.Tensor:
    """The rows' shifts (B,) on ``device``, built from host data once per (shifts, device), not per step."""
    return torch.tensor(shift, device=device)


BOUND_ELEMENTS = 1 << 25  # largest (rows x pages) temporary of one pass of page_bounds


def page_bounds(
    page_min: torch.Tensor, page_max: torch.Tensor, query: torch.Tensor, empty=True
) -> torch.Tensor:
    """Quest's upper bound of q·k over each page, max over a GQA group's query heads and over the queries
    of a chunk: (B, H_kv, P), -inf for empty pages (no real token).

    Per channel ``max(q min, q max)`` bounds ``q_i k_i`` for every key of the page; with ``min <= max`` it
    is ``max`` where ``q_i >= 0`` and ``min`` elsewhere, so the bound is two batched products over all
    pages at once, ``relu(q) . max + min(q, 0) . min``, not an elementwise pass per page and channel.

    Args:
        page_min, page_max: (B, H_kv, P, D) per-channel key bounds of each page (+inf / -inf when empty).
        query: (B, H, q, D).
        empty: whether a page may hold no token (padding); False skips their mask.
    """
    b, h_kv, p, d = page_min.shape
    q = query.reshape(b, h_kv, -1, d)  # (B, H_kv, g*q, D): heads h_kv*g .. share KV head h_kv
    step = max(1, BOUND_ELEMENTS // max(b * h_kv * p, 1))  # query rows per pass: bounded temporaries
    bound = None
    for i in range(0, q.shape[2], step):
        part = q[:, :, i : i + step]
        # an empty page's +-inf give inf or NaN in its own column only; masked below
        part = (part.clamp(min=0) @ page_max.mT + part.clamp(max=0) @ page_min.mT).amax(2)  # (B, H_kv, P)
        bound = part if bound is None else torch.maximum(bound, part)
    return bound.masked_fill(~(page_max[..., 0] >= page_min[..., 0]), -math.inf) if empty else bound


def _grow(meta: torch.Tensor | None, like: torch.Tensor, n_pages: int, fill: float) -> torch.Tensor:
    """``meta`` (B, H_kv, P, D) extended to ``n_pages`` pages filled with ``fill`` (a new tensor if grown)."""
    have = 0 if meta is None else meta.shape[2]
    if have >= n_pages:
        return meta
    b, h, _, d = like.shape
    extra = torch.full((b, h, n_pages - have, d), fill, dtype=like.dtype, device=like.device)
    return extra if meta is None else torch.cat([meta, extra], dim=2)
