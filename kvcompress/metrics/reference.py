"""The reference of every ``cache_ratio``: the bytes ``full`` holds over the same tokens, fed the same way.

A cache grows its buffers with headroom (``core.buffers.headroom``: one spare slot per 128 tokens, counted
as memory), so ``full`` after a prefill of P tokens and D one-token steps holds a little more than ``full``
after one prefill of P + D tokens (about 0.5% on a 2k-token retrieval case). A ratio against the second
would show ``full`` at 1.005 against itself; ``prefill=P`` gives the first, and ``chunk=C`` a stream of
C-token forwards after it (decode-mode perplexity), so ``full`` reads exactly 1.000 against itself.
"""

from __future__ import annotations

import weakref

import torch

from kvcompress.core.cache import build_cache

_FULL_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: bytes of one row}


def full_cache_bytes(
    model, tokens: int, batch: int = 1, prefill: int | None = None, chunk: int | None = None
) -> int:
    """Bytes of the uncompressed (``full``) cache over ``tokens`` tokens: the reference of ``cache_ratio``.

    Measured on one row of a real ``full`` cache and multiplied by ``batch``: every tensor ``full`` holds is
    per row (keys, values; positions and padding offsets on windowed layers), so a batch holds exactly
    ``batch`` times one row's bytes. One row is measured once per model, length and feeding.

    Args:
        tokens: tokens the cache consumed.
        prefill: the tokens of the first forward when the others came in later forwards (retrieval: the
            prompt, then the question and answer tokens); None: no separate first forward.
        chunk: tokens per later forward (1 when None and ``prefill`` is set); with neither, all ``tokens``
            in one forward.
    """
    if prefill is not None and not 1 <= prefill <= tokens:
        raise ValueError(f"full_cache_bytes: prefill={prefill} must be in [1, tokens={tokens}]")
    if chunk is not None and chunk < 1:
        raise ValueError(f"full_cache_bytes: chunk={chunk} must be >= 1")
    steps = _steps(tokens, prefill, chunk)
    known = _FULL_BYTES.setdefault(model, {})
    key = (tokens, steps[0], steps[1] if len(steps) > 1 else None, str(model.dtype), str(model.device))
    if key not in known:
        known[key] = _measure_full(model, tokens) if len(steps) == 1 else _replay_full(model, steps)
    return batch * known[key]


def _steps(tokens: int, prefill: int | None, chunk: int | None) -> list[int]:
    """The sizes of the forwards that fed ``tokens`` tokens."""
    if prefill is None and chunk is None:
        return [tokens]
    first = prefill or 0
    chunk = chunk or 1
    return ([first] if first else []) + [min(chunk, tokens - s) for s in range(first, tokens, chunk)]


@torch.inference_mode()
def _measure_full(model, tokens: int) -> int:
    """One row of ``full`` after one forward of ``tokens`` tokens."""
    cache = build_cache("full", model)
    ids = torch.zeros(1, tokens, dtype=torch.long, device=model.device)
    model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache.memory_bytes()


@torch.inference_mode()
def _replay_full(model, steps: list[int]) -> int:
    """One row of ``full`` after forwards of ``steps`` tokens each, each layer driven by hand (what it stores
    depends on the step sizes only, not on the values)."""
    cache = build_cache("full", model)
    for layer in cache.layers:
        shape = (1, layer.spec.num_kv_heads, 0, layer.spec.head_dim)
        for q in steps:
            size = (*shape[:2], q, shape[3])
            keys = torch.zeros(size, dtype=model.dtype, device=model.device)
            layer.step(keys, torch.zeros_like(keys))
            if layer.open or layer.deferred:
                layer.end_deferred()  # the step's attention never comes: end it as the model's would
    return cache.memory_bytes()
