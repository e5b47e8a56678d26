"""Did a run really compress? One definition for every task, and a warning when it did not.

``compressed`` is true when the cache held fewer tokens than the sequence consumed (``tokens_evicted``), held
fewer bytes than ``full`` on the same tokens (``cache_ratio`` below 1: quantized and low-rank storages), or
its steps attended to fewer tokens than the model's own attention would have (``read_ratio`` below 1: Quest
pages, a tiered cache's cold tier). A policy that never acts in the chosen setting (SnapKV or PyramidKV under
one-token streaming, a budget that covers the whole text) reports ``full``'s numbers; such a run is marked
``compressed: false`` with a ``warning`` that says why and what to set, never passed off as a result.
"""

from __future__ import annotations

import warnings
from collections import Counter

from kvcompress.metrics.reference import full_cache_bytes as full_cache_bytes  # the reference, re-exported


def tokens_evicted(cache) -> int:
    """Tokens dropped so far, summed over layers (``stats()["tokens_evicted"]``; 0 for layers without it)."""
    return sum(int(s.get("tokens_evicted", 0)) for s in cache.stats())


def read_counts(cache) -> tuple[float, int]:
    """Tokens the cache's steps read (each step's last query, summed over layers and steps) and tokens the
    model's own attention would have read in the same steps (``PolicyLayer.count_read``)."""
    stats = cache.stats() if hasattr(cache, "stats") else []
    return sum(s.get("tokens_read", 0.0) for s in stats), sum(s.get("tokens_visible", 0) for s in stats)


def attention_backends(cache) -> dict[str, int]:
    """Layer-steps each attention backend ran (``kvcompress.kernels.backends``: ``{"cpu": n, "sdpa": m}``),
    summed
    over the cache's layers: which code computed a result's numbers. {} for a cache without the counters."""
    total: Counter = Counter()
    for s in cache.stats() if hasattr(cache, "stats") else []:
        total.update(s.get("attention_backends", {}))
    return dict(sorted(total.items()))


def read_ratio(cache) -> float | None:
    """``tokens_read / tokens_visible`` of ``cache`` (1.0 for ``full`` on every family), None before any step
    or for a cache without read counters (transformers' own)."""
    read, visible = read_counts(cache)
    return read / visible if visible else None


def is_compressed(evicted: int, cache_bytes: int, full_bytes: int, read: float | None = None) -> bool:
    """Tokens were evicted, the cache holds fewer bytes than ``full`` would on the same tokens, or its steps
    read fewer tokens than the model's attention would have (``read``: the read ratio, None if unknown)."""
    return evicted > 0 or cache_bytes < full_bytes or (read is not None and read < 1.0 - 1e-9)


def flag_uncompressed(policy_name: str, what: str, hint: str) -> dict:
    """``{"warning": ...}`` (also ``warnings.warn``-ed) for a policy other than ``full``, else ``{}``.

    Args:
        what: where it did not compress and the evidence ("in this run: 0 tokens evicted ...").
        hint: what to set so that the policy acts in this setting (task-specific).
    """
    if policy_name == "full":
        return {}
    message = f"policy {policy_name!r} did not compress {what}; those numbers are full's. {hint}"
    warnings.warn(message, stacklevel=3)
    return {"warning": message}


def compression_check(
    policy_name: str, evicted: int, cache_bytes: int, full_bytes: int, hint: str, read: float | None = None
) -> dict:
    """``{"tokens_evicted", "read_ratio", "compressed"}`` of one cache, plus ``warning`` when a policy other
    than ``full`` evicted no token, held no fewer bytes than ``full`` and read every token it could."""
    compressed = is_compressed(evicted, cache_bytes, full_bytes, read)
    result = {"tokens_evicted": int(evicted), "read_ratio": read, "compressed": compressed}
    if not compressed:
        evidence = (
            f"0 tokens evicted, every token read (read_ratio {read}) and {cache_bytes} cache bytes vs "
            f"{full_bytes} for 'full' on the same tokens"
        )
        result |= flag_uncompressed(policy_name, f"in this run ({evidence})", hint)
    return result


def kept_counts(stats: list[dict]) -> tuple[list[int], list[list[int]]]:
    """Per layer of ``cache.stats()``: tokens seen, and tokens stored in each KV head (``tokens_per_head``:
    a threshold or head-adaptive budgets give heads their own counts; one entry for a layer that reports
    none). Row 0 of a batch."""
    seen = [int(s.get("tokens_seen", 0)) for s in stats]
    kept = [
        list(s.get("tokens_per_head") or [s.get("tokens_stored", n)])
        for s, n in zip(stats, seen, strict=True)
    ]
    return seen, kept


def ratios_of(seen: list[int], kept: list[list[float]]) -> dict:
    """``effective_compression_ratio`` (tokens removed over tokens seen, all layers and KV heads),
    ``effective_ratio_per_layer`` and, per layer, ``effective_ratio_per_head``, from ``kept_counts`` (or
    their sums over requests)."""

    def ratio(k: float, n: float) -> float:
        return round(1.0 - k / n, 6) if n else 0.0

    means = [sum(heads) / len(heads) for heads in kept]
    return {
        "effective_compression_ratio": ratio(sum(means), sum(seen)),
        "effective_ratio_per_layer": [ratio(k, n) for k, n in zip(means, seen, strict=True)],
        "effective_ratio_per_head": [
            [ratio(k, n) for k in heads] for heads, n in zip(kept, seen, strict=True)
        ],
    }


def effective_ratios(stats: list[dict]) -> dict:
    """The compression a cache really reached, from its ``stats()`` (``ratios_of`` its ``kept_counts``):
    what a ``threshold`` leaves, and what a ratio leaves once decode tokens are appended."""
    return ratios_of(*kept_counts(stats))
