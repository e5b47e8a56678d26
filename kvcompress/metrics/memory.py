"""Process and device memory; the cache's own bytes come from ``KVCache.memory_bytes()``."""

from __future__ import annotations

import resource
import sys

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_device_bytes(device) -> int | None:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    return None


def fixed_bytes(cache) -> int:
    """Bytes of per-model constants (low-rank bases) a cache holds: shared by every sequence, so reported
    apart from the per-token bytes."""
    return _store_bytes(cache, "fixed_tensors")


def shared_bytes(cache) -> int:
    """Bytes the cache's policy holds outside ``memory_bytes()``, once however many layers share them: the
    pre-RoPE rotary table (``Store.shared_tensors``), shared by every cache of the policy and depending on
    no cached token."""
    return _store_bytes(cache, "shared_tensors")


def _store_bytes(cache, which: str) -> int:
    """Distinct storage bytes of what every layer's store lists under ``which`` (a tensor shared by layers
    counts once)."""
    from kvcompress.core.buffers import storage_bytes

    return storage_bytes(t for layer in cache.layers for t in getattr(layer.store, which)())


def read_summary(stats: list[dict]) -> dict:
    """KV bytes read per decode step over all layers, for policies that count reads (``block_sparse``).

    Layers without read counters (other policies in a schedule) read all their tokens and are not
    included. Returns an empty dict when no layer counts reads.
    """
    counted = [s for s in stats if s.get("decode_steps")]
    if not counted:
        return {}
    steps = counted[0]["decode_steps"]
    total = {k: sum(s[k] for s in counted) for k in ("kv_bytes_read", "meta_bytes_read", "kv_bytes_full")}
    pages = sum(s["pages_read"] for s in counted) / max(sum(s["pages_total"] for s in counted), 1)
    read = total["kv_bytes_read"] + total["meta_bytes_read"]
    return {
        "read_bytes_per_step": read / steps,
        "kv_bytes_read_per_step": total["kv_bytes_read"] / steps,
        "full_read_bytes_per_step": total["kv_bytes_full"] / steps,
        "read_bytes_ratio": read / max(total["kv_bytes_full"], 1),
        "pages_read_fraction": pages,
        # the share of those steps whose pages were read in place, not gathered (block_sparse's kernel)
        "in_place_fraction": sum(s.get("in_place_steps", 0) for s in counted)
        / sum(s["decode_steps"] for s in counted),
    }


def tier_summary(stats: list[dict]) -> dict:
    """Bytes per tier and fetch traffic over all layers of a tiered cache (``offload`` storage): device,
    host and disk bytes, pages and bytes fetched per step (summed over layers), and the LRU hit rate (the
    cache hit rate). Empty for caches without a cold tier."""
    tiered = [s for s in stats if "lru_lookups" in s]
    if not tiered:
        return {}
    total = {k: sum(s[k] for s in tiered) for k in ("host_bytes", "disk_bytes", "lru_hits", "lru_lookups")}
    return {
        "device_bytes": sum(s["bytes"] for s in stats),
        "host_bytes": total["host_bytes"],
        "disk_bytes": total["disk_bytes"],
        "pages_fetched_per_step": sum(s["pages_fetched_per_step"] for s in tiered),
        "bytes_fetched_per_step": sum(s["bytes_fetched_per_step"] for s in tiered),
        "lru_hit_rate": total["lru_hits"] / max(total["lru_lookups"], 1),
        "read_ratio_capped": any(s.get("read_ratio_capped", False) for s in stats),  # fewer reads than asked
    }
