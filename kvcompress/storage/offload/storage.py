"""Offload storage: the hot tokens on the device, whole cold pages in host memory or on disk.

The hierarchical cache of InfLLM (Xiao et al., arXiv 2402.04617), Quest (Tang et al., arXiv 2406.10774)
and ShadowKV (Sun et al., arXiv 2410.21465): every token stays reachable, but only what a step needs is on
the device. The device tier holds the recent window (the newest ``recent`` tokens and the page being
filled), one summary per cold page (per-channel key min and max, as Quest) and an LRU of the pages fetched
back (``lru_pages`` per row and KV head: its byte budget is ``lru_pages * 2 * block_size * D`` elements).
Pages of ``block_size`` tokens leave the device at the end of the step in which they fall out of the
recent window, into the ``tier`` (``host``: pinned CPU memory under CUDA; ``disk``: a memory-mapped file per
layer under ``dir``, see ``cold.py``). ``memory_bytes()`` counts the device tier; ``stats()`` all tiers.
``summary_dtype`` (``model``, ``float16``, ``bfloat16``) stores the page bounds narrower, rounded outward so
they stay bounds: half their bytes on a float32 model, which a byte budget can spend on more fetched pages.

Only a selector that reads pages by score (``tiered``) can serve it: other selectors read every stored
token at every step, which would bring the whole cache back.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvcompress.core import buffers
from kvcompress.core.fields import Choice, Int
from kvcompress.core.storage import KINDS, Storage, Store, reorder_all
from kvcompress.storage.offload import page_lru
from kvcompress.storage.offload.cold import ColdPages

TIERS = ("host", "disk")
SUMMARY_DTYPES = {"model": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _narrow(bound: torch.Tensor, name: str, direction: int) -> torch.Tensor:
    """``bound`` in the summary dtype ``name``, rounded outward (``direction`` -1: down for a minimum, +1: up
    for a maximum), so the page bound of Quest stays a bound."""
    dtype = SUMMARY_DTYPES[name]
    if dtype is None or bound.dtype == dtype:
        return bound
    out = bound.to(dtype)
    wrong = out.to(bound.dtype) > bound if direction < 0 else out.to(bound.dtype) < bound
    return torch.where(wrong, torch.nextafter(out, torch.full_like(out, direction * math.inf)), out)


class OffloadStore(Store):
    """Hot tail ``keys``/``values`` (B, H_kv, W, D), cold pages in ``cold``, their key bounds
    ``page_min``/``page_max`` (B, H_kv, P, D) and the fetched pages ``lru`` on the device."""

    fixed_rows = (
        "the cold tier and the device LRU lay pages out per batch row, so the batch cannot change size "
        "(num_return_sequences > 1 or contrastive search); use num_beams (a reorder of the same rows), or "
        "another storage"
    )

    def __init__(self, config, layer_idx, spec, kinds=KINDS):
        super().__init__(config, layer_idx, spec, kinds)
        self.slots = buffers.Slots()
        self.cold: ColdPages | None = None
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = self.page_min = self.page_max = self.lru = None
        self.cold_pages = 0
        self.counters = {"tick": 0, "lookups": 0, "hits": 0, "pages_fetched": 0, "pages_prefetched": 0}
        if self.cold is not None:
            self.cold.clear()

    @property
    def length(self) -> int:
        hot = 0 if self.keys is None else self.keys.shape[-2]
        return self.cold_pages * self.config.block_size + hot

    def append(self, keys, values, positions=None) -> None:
        self.keys = self.slots.extend("keys", self.keys, keys)
        self.values = self.slots.extend("values", self.values, values)

    def read(self):
        """The hot tokens only (slots ``cold_pages * block_size`` on); cold pages come through ``fetch``."""
        return self.keys, self.values

    def crop_refusal(self, n: int) -> str | None:
        """None when the newest ``n`` tokens are in the hot tail and no page went cold because of them (the
        cold count is what ``flush`` would give without them); else why not."""
        bs, hot = self.config.block_size, 0 if self.keys is None else self.keys.shape[-2]
        if n > hot:
            return f"the newest {n} tokens are not all in the hot tail of {hot} (older pages went cold)"
        if max(0, (self.length - n - self.config.recent) // bs) != self.cold_pages:
            return "they pushed a page out of the recent window to the cold tier, which cannot be undone"
        return None

    def crop_conditions(self) -> list[str]:
        return ["the rejected tokens sent no page to the cold tier"]

    def crop(self, n: int) -> None:
        """Cut the hot tail's newest ``n`` tokens (leading slices: their slots become headroom)."""
        hot = self.keys.shape[-2] - n
        self.keys, self.values = self.keys[:, :, :hot], self.values[:, :, :hot]

    def keep(self, idx) -> None:
        raise NotImplementedError("offload storage evicts nothing: only the tiered selector serves it")

    def flush(self, valid=None) -> None:
        """End of a step: pages older than the recent window go to the cold tier, with their summaries."""
        bs = self.config.block_size
        target = max(0, (self.length - self.config.recent) // bs)
        m = target - self.cold_pages
        if m <= 0:
            return
        b, h, _, d = self.keys.shape
        k, v = self.keys[:, :, : m * bs], self.values[:, :, : m * bs]  # (B, H_kv, m * bs, D)
        if valid is not None:
            start = self.cold_pages * bs
            valid = valid[:, :, start : start + m * bs].view(b, -1, m, bs, 1)
        self._summarise(k.view(b, h, m, bs, d), valid)
        rows = torch.cat([k.reshape(b, h, m, bs * d), v.reshape(b, h, m, bs * d)], dim=-1)
        if self.cold is None:
            self.cold = ColdPages(self.config.tier, self.config.dir, 2 * bs * d, k.dtype, k.device)
        self.cold.append(rows.permute(2, 0, 1, 3).reshape(m * b * h, -1).to("cpu"))  # page-major rows
        self.cold_pages = target
        self.keys = self.slots.take_spans("keys", self.keys, [(m * bs, self.keys.shape[-2])])
        self.values = self.slots.take_spans("values", self.values, [(m * bs, self.values.shape[-2])])

    def _summarise(self, pages: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Append the key min/max (B, H_kv, m, D) of ``pages`` (B, H_kv, m, bs, D); padding excluded."""
        lo, hi = pages, pages
        if valid is not None:
            lo, hi = pages.masked_fill(~valid, math.inf), pages.masked_fill(~valid, -math.inf)
        lo, hi = (
            _narrow(lo.amin(3), self.config.summary_dtype, -1),
            _narrow(hi.amax(3), self.config.summary_dtype, 1),
        )
        self.page_min = lo if self.page_min is None else torch.cat([self.page_min, lo], dim=2)
        self.page_max = hi if self.page_max is None else torch.cat([self.page_max, hi], dim=2)

    def summaries(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Key min and max (B, H_kv, P, D) of the cold pages (in ``dtype`` when given)."""
        if dtype is None or self.page_min.dtype == dtype:
            return self.page_min, self.page_max
        return self.page_min.to(dtype), self.page_max.to(dtype)

    @property
    def prefetches(self) -> bool:
        """Whether this store prefetches the next layer's likely pages (``prefetch``; auto: on CUDA)."""
        mode = self.config.prefetch
        return mode == "on" or (mode == "auto" and self.keys is not None and self.keys.is_cuda)

    def fetch(
        self, pages: torch.Tensor, ahead: OffloadStore | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H_kv, k * block_size, D) of cold ``pages`` (B, H_kv, k) (-1: unspecified rows),
        through the device LRU (hits stay, misses are copied from the cold tier). ``ahead``: the next layer's
        store, whose LRU receives the same pages now (prefetched, in the same read)."""
        self._grow_lru()
        nxt = None
        if (
            ahead is not None
            and self.prefetches
            and ahead.cold_pages == self.cold_pages
            and ahead.keys is not None
        ):
            ahead._grow_lru()
            if ahead.lru.page.shape == self.lru.page.shape:
                nxt = (ahead.lru, ahead._from_cold, ahead.counters)
        rows = page_lru.lookup(self.lru, pages, self._from_cold, self.counters, nxt)  # (B, H_kv, k, 2*bs*D)
        b, h, _, d = self.keys.shape
        bs = self.config.block_size
        kv = rows.view(b, h, -1, 2, bs, d)
        return kv[:, :, :, 0].reshape(b, h, -1, d), kv[:, :, :, 1].reshape(b, h, -1, d)

    def _grow_lru(self) -> None:
        b, h, _, d = self.keys.shape
        want = min(self.config.lru_pages, self.cold_pages)
        row = 2 * self.config.block_size * d
        self.lru = page_lru.grow(self.lru, b, h, want, row, self.keys.dtype, self.keys.device)

    def _from_cold(self, triples, slots) -> None:
        """Host (b, h, page) and slot arrays: the pages' rows and ids into the LRU."""
        b, h = self.keys.shape[:2]
        bi, hi, page = triples
        self.cold.fetch_into((page * b + bi) * h + hi, slots, page, self.lru.rows, self.lru.page.view(-1))

    def reorder(self, beam_idx) -> None:
        reorder_all(self, ("keys", "values", "page_min", "page_max"), beam_idx)
        self.lru = page_lru.reorder(self.lru, beam_idx)
        if self.cold is not None and self.cold.used:
            data = self.cold.data[: self.cold.used]
            b = beam_idx.shape[0]
            data.view(self.cold_pages, b, -1).copy_(data.view(self.cold_pages, b, -1)[:, beam_idx.cpu()])
        self.slots.clear()

    def reset(self) -> None:
        self._clear()
        self.slots.clear()

    def tensors(self):
        return [self.keys, self.values, self.page_min, self.page_max, *(self.lru or ())]

    def stats(self) -> dict:
        c, d = self.counters, self.spec.head_dim
        size = 0 if self.keys is None else self.keys.element_size()
        page_bytes = 2 * self.config.block_size * d * size
        cold = 0 if self.cold is None else self.cold.nbytes()
        steps = max(c["tick"], 1)
        return {
            "storage": self.config.name,
            "tier": self.config.tier,
            "device_bytes": buffers.storage_bytes(self.tensors()),
            "host_bytes": cold if self.config.tier == "host" else 0,
            "disk_bytes": cold if self.config.tier == "disk" else 0,
            "cold_pages": self.cold_pages,
            "fetch_steps": c["tick"],
            "pages_fetched": c["pages_fetched"],
            "pages_prefetched": c.get("pages_prefetched", 0),
            "bytes_fetched": c["pages_fetched"] * page_bytes,
            "pages_fetched_per_step": c["pages_fetched"] / steps,
            "bytes_fetched_per_step": c["pages_fetched"] * page_bytes / steps,
            "lru_lookups": c["lookups"],
            "lru_hits": c["hits"],
            "lru_hit_rate": c["hits"] / max(c["lookups"], 1),
        }


@dataclass
class OffloadStorage(Storage):
    """Hot window and fetched pages on the device, cold pages in host memory or on disk (``tier``)."""

    name = "offload"
    store_class = OffloadStore
    TEST_PARAMS = [{"block_size": 4, "recent": 8, "lru_pages": 3}, {"block_size": 4, "recent": 5,
                   "lru_pages": 4, "tier": "disk"}]  # fmt: skip
    FUZZ = {"block_size": (1, 8), "recent": (0, 12), "lru_pages": (1, 8), "tier": list(TIERS),
            "summary_dtype": list(SUMMARY_DTYPES)}  # fmt: skip

    block_size: int = Int(8, low=1)
    recent: int = Int(32, low=0)
    lru_pages: int = Int(38, low=1)
    tier: str = Choice("host", TIERS)
    dir: str | None = None
    summary_dtype: str = Choice("model", tuple(SUMMARY_DTYPES))
    prefetch: str = Choice("auto", ("auto", "on", "off"))

    def __post_init__(self):
        super().__post_init__()
        if self.dir is not None and not isinstance(self.dir, str):
            raise ValueError(f"offload.dir={self.dir!r} must be a folder path (a string) or null")

    def refuses(self, selector, kinds=KINDS) -> str | None:
        if selector.reads_pages:
            return None
        return (
            "offload keeps cold pages off the device and serves only a selector that fetches pages by "
            f"score; {selector.selector} reads every stored token at every step: use policy=tiered, or "
            "another storage with this selector"
        )

    def covering(self, n_tokens: int) -> OffloadStorage:
        """Every page fits in the LRU (nothing read from the cold tier is ever dropped)."""
        return dataclasses.replace(self, lru_pages=max(self.lru_pages, n_tokens // self.block_size + 2))

    def bytes_for(self, s, tokens: int) -> None:
        return None  # device bytes depend on the selector's reads, not only on the count
