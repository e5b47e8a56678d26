"""Why a policy did not act in a Python-API measurement, and the fields that say whether it did.

The command line's tasks flag a run whose policy never compressed (``metrics.compression``); a result of
``decode_perplexity`` carries the same fields and the same warning, with its cause named in the API's own
terms: a prefill-only selector without a prefix, a context pass not run, an exact window larger than what
is kept, a budget that covers the text.
"""

from __future__ import annotations

from kvcompress.metrics.acted import storage_cause, storage_check, storage_use, window_check
from kvcompress.metrics.compression import compression_check, effective_ratios, read_ratio, tokens_evicted
from kvcompress.metrics.memory import fixed_bytes
from kvcompress.metrics.reference import full_cache_bytes
from kvcompress.runtime.context_pass import needs_context_pass


def prefill_only(cache) -> bool:
    """Whether the cache's policy acts only on a forward of several tokens (``evicts == "prefill"``: SnapKV,
    PyramidKV, expected attention, KVzap) or in a context pass after a prefill (KVzip)."""
    policy = getattr(cache, "policy", None)
    return getattr(policy, "evicts", "never") == "prefill" or needs_context_pass(cache)


def idle_cause(cache, prefix: int, chunk_size: int) -> str:
    """What kept the policy of ``cache`` from acting, and what to pass instead (``decode_perplexity``'s
    arguments). ``prefix``: tokens of the one prefill (0: none)."""
    stats = cache.stats()
    storage = storage_cause(cache, storage_use(stats))
    if storage:
        return storage + "."
    name = cache.policy.selector
    auto = "prefix_tokens='auto' (the default) prefills half the text"
    if needs_context_pass(cache) and not any(s.get("context_passes") for s in stats):
        return (
            f"{name} evicts only in its context pass after a prefill, and none ran: pass prefix_tokens=N "
            f"(prefill N tokens, run the pass, score the rest; {auto}) with after_prefix=None, or call "
            "kvcompress.runtime.context_pass.compress_context in your after_prefix."
        )
    if prefill_only(cache) and not prefix:
        return (
            f"{name} compresses only a forward of several tokens (a prefill), and every forward here carried "
            f"chunk_size={chunk_size} token(s): pass prefix_tokens=N ({auto}) or a larger chunk_size."
        )
    held = max(int(s.get("tokens_stored", 0)) for s in stats)
    return (
        f"No layer held more than its budget allows ({held} tokens at most): lower the policy's budget "
        f"(budget, compression_ratio, window) below the {prefix or 'streamed'} tokens it compresses."
    )


def policy_acted(model, cache, tokens: int, cause: str, prefill=None, chunk=None) -> dict:
    """``cache_bytes``, ``full_cache_bytes`` (``full`` over the same ``tokens``), ``cache_ratio``,
    ``tokens_evicted``, ``read_ratio`` and ``compressed`` of ``cache``; a ``warning`` with ``cause`` when its
    policy (not ``full``) did not compress; the storage's and SnapKV window's flags (``metrics.acted``).
    ``prefill`` and ``chunk``: how the tokens were fed (``full_cache_bytes``), so ``full`` reads 1.000."""
    held, full = cache.memory_bytes(), full_cache_bytes(model, tokens, prefill=prefill, chunk=chunk)
    out = {"cache_bytes": held, "full_cache_bytes": full, "cache_ratio": held / full}
    out |= effective_ratios(cache.stats())
    per_token = held - fixed_bytes(cache)  # a low-rank basis is per model, not per token
    out |= compression_check(
        cache.policy.name, tokens_evicted(cache), per_token, full, cause, read_ratio(cache)
    )
    out |= storage_check(cache, warn=out["compressed"])  # otherwise the warning above names it already
    return out | window_check(cache)
