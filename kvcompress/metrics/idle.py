"""Why a policy did not act in a Python-API measurement, and the fields that say whether it did.

The command line's tasks flag a run whose policy never compressed (``metrics.compression``); a result of
``decode_perplexity`` carries the same fields and the same warning, with its cause named in the API's own
terms: a prefill-only selector without a prefix, a context pass not run, an exact window larger than what
is kept, a budget that covers the text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Knobs:
    """How a caller names the settings that make a policy act, for ``idle_cause``'s advice: ``chunk`` the
    tokens per forward, ``prefill`` and ``context_pass`` what to set for a selector that acts on a prefill or
    in a context pass, ``below(prefix)`` what a budget must be below (``prefix`` 0: no prefill)."""

    chunk: str
    prefill: str
    context_pass: str
    below: Callable[[int], str]


_AUTO = "prefix_tokens='auto' (the default) prefills half the text"
API = Knobs(  # decode_perplexity's arguments
    chunk="chunk_size",
    prefill=f"pass prefix_tokens=N ({_AUTO}) or a larger chunk_size",
    context_pass=(
        f"pass prefix_tokens=N (prefill N tokens, run the pass, score the rest; {_AUTO}) with "
        "after_prefix=None, or call kvcompress.runtime.context_pass.compress_context in your after_prefix"
    ),
    below=lambda prefix: f"the {prefix or 'streamed'} tokens it compresses",
)


def idle_cause(cache, prefix: int, chunk_size: int, knobs: Knobs = API) -> str:
    """What kept the policy of ``cache`` from acting, and what to set instead, in ``knobs``' names (the
    Python API's by default). ``prefix``: tokens of the one prefill (0: none)."""
    stats = cache.stats()
    storage = storage_cause(cache, storage_use(stats))
    if storage:
        return storage + "."
    name = cache.policy.selector
    if needs_context_pass(cache) and not any(s.get("context_passes") for s in stats):
        return f"{name} evicts only in its context pass after a prefill, and none ran: {knobs.context_pass}."
    if prefill_only(cache) and not prefix:
        return (
            f"{name} compresses only a forward of several tokens (a prefill), and every forward here carried "
            f"{knobs.chunk}={chunk_size} token(s): {knobs.prefill}."
        )
    held = max(int(s.get("tokens_stored", 0)) for s in stats)
    return (
        f"Its budget covers every token (no layer held more than {held}): lower the policy's budget "
        f"(budget, compression_ratio, window) below {knobs.below(prefix)}."
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
