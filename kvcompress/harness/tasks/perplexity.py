"""Decode-mode perplexity, cache memory and speed of one policy on the first ``max_tokens`` of a text.

``prefix_tokens`` turns it into prefix perplexity: compress a prompt in one prefill, score the rest. A
policy that never compressed is marked ``compressed: false`` with a ``warning`` (see ``metrics.compression``).
"""

from __future__ import annotations

import functools
import time

from kvcompress.core.cache import build_cache
from kvcompress.harness.guard import check_fits
from kvcompress.harness.tasks.slices import combine_slices, slice_ids, slice_starts
from kvcompress.metrics import decode_perplexity, measure_speed, peak_rss_bytes
from kvcompress.metrics.acted import storage_check, window_check
from kvcompress.metrics.compression import (
    attention_backends,
    compression_check,
    full_cache_bytes,
    read_ratio,
    tokens_evicted,
)
from kvcompress.metrics.idle import Knobs, idle_cause
from kvcompress.metrics.memory import (
    fixed_bytes,
    peak_device_bytes,
    read_summary,
    shared_bytes,
    tier_summary,
)
from kvcompress.resources.data import load_text
from kvcompress.runtime.context_pass import after_prefill
from kvcompress.storage.low_rank.calibration_text import cache_spans, check_disjoint, text_span


def text_tokens(tokenizer, text_name: str, max_tokens: int, offset_tokens: int = 0, max_positions: int = 0):
    """The token ids (1, max_tokens) of a text, with clear errors for short texts or long requests."""
    if max_positions and max_tokens > max_positions:
        raise ValueError(
            f"task.max_tokens={max_tokens} exceeds the model's context of {max_positions} positions"
        )
    ids = tokenizer(load_text(text_name), return_tensors="pt").input_ids[:, offset_tokens:]
    if ids.shape[1] < max_tokens:
        raise ValueError(
            f"task.max_tokens={max_tokens}: text {text_name!r} has only {ids.shape[1]} tokens after "
            f"offset_tokens={offset_tokens}"
        )
    return ids[:, :max_tokens]


def _knobs(cfg) -> Knobs:
    """The task's names for what makes a policy act (``metrics.idle.idle_cause``)."""
    prefix = "set task.prefix_tokens (compress that many tokens in one prefill"
    return Knobs(
        chunk="task.chunk_size",
        prefill=f"{prefix}, score the rest) or a larger task.chunk_size",
        context_pass=f"{prefix}, run the pass, score the rest)",
        below=lambda n: f"task.prefix_tokens={n}" if n else f"task.max_tokens={cfg.max_tokens}",
    )


def _score(model, tokenizer, ids, policy, cfg, chars) -> dict:
    """Decode-mode (or prefix) perplexity, bytes vs ``full`` on the same tokens, and did it compress.
    ``chars()``: the characters of ``cfg.text`` that ``ids`` cover (refused if a calibration read them)."""
    start = time.perf_counter()
    cache = build_cache(policy, model)  # includes a calibrating policy's calibration (or its reload)
    build_s = time.perf_counter() - start
    spans = cache_spans(cache)
    check_disjoint(spans, cfg.text, chars, f"task=perplexity (max_tokens={cfg.max_tokens})")
    metrics = decode_perplexity(
        model,
        ids,
        cache,
        chunk_size=cfg.chunk_size,
        progress=cfg.get("progress", True),
        prefix_tokens=cfg.get("prefix_tokens"),
        after_prefix=after_prefill(model, tokenizer),
        check=False,  # checked below, with the task's own settings named
    )
    metrics["build_cache_s"] = build_s
    metrics["calibration_ranges"] = spans
    metrics["cache_bytes"] = cache.memory_bytes()
    metrics["fixed_bytes"] = fixed_bytes(cache)  # per-model constants (low-rank bases), not per token
    metrics["shared_bytes"] = shared_bytes(cache)  # beside cache_bytes: the pre-RoPE rotary table, once
    metrics["tokens_stored_mean"] = sum(s["tokens_stored"] for s in cache.stats()) / len(cache.layers)
    metrics.update(read_summary(cache.stats()))  # block_sparse: bytes read per decode step
    metrics.update(tier_summary(cache.stats()))  # tiered: bytes per tier, fetches, LRU hit rate
    fed = {"prefill": metrics["prefix_tokens"], "chunk": cfg.chunk_size}  # full fed as the policy was
    metrics["full_cache_bytes"] = full_cache_bytes(model, ids.shape[1] - 1, **fed)  # the tokens consumed
    metrics["cache_ratio"] = metrics["cache_bytes"] / metrics["full_cache_bytes"]
    per_token = metrics["cache_bytes"] - metrics["fixed_bytes"]
    metrics["per_token_cache_ratio"] = per_token / metrics["full_cache_bytes"]  # bases left out
    metrics["attention_backends"] = attention_backends(cache)  # which backend computed the numbers
    cause = idle_cause(cache, cfg.get("prefix_tokens") or 0, cfg.chunk_size, _knobs(cfg))
    check = compression_check(
        policy.name, tokens_evicted(cache), per_token, metrics["full_cache_bytes"], cause, read_ratio(cache)
    )
    check |= storage_check(cache, warn=check["compressed"])  # a run that did not compress warned with it
    return metrics | check | window_check(cache)


def run(model, tokenizer, policy, cfg) -> dict:
    """Perplexity (decode mode, or prefix perplexity with ``prefix_tokens``) over ``task.slices`` disjoint
    slices of the text, as exp of the mean NLL with a 95% interval on that log scale (``combine_slices``);
    bytes vs ``full`` on the same tokens, whether the policy compressed, prefill/decode speed (median and
    interquartile range)."""
    spec_max = getattr(model.config, "max_position_embeddings", 0)
    if spec_max and cfg.max_tokens > spec_max:
        raise ValueError(
            f"task.max_tokens={cfg.max_tokens} exceeds the model's context of {spec_max} positions"
        )
    check_fits(model, cfg.max_tokens, chunk=max(cfg.chunk_size, cfg.get("prefix_tokens") or 0))
    body, starts = load_text(cfg.text), slice_starts(cfg)
    pieces = slice_ids(tokenizer, body, starts, cfg.max_tokens, cfg.text)
    per_slice = []
    for start, ids in zip(starts, pieces, strict=True):
        span = functools.partial(text_span, tokenizer, body, start, start + cfg.max_tokens)
        per_slice.append({"offset_tokens": start, **_score(model, tokenizer, ids, policy, cfg, span)})
    metrics = combine_slices(per_slice)
    if cfg.get("speed", True):
        prompt = pieces[0][:, : cfg.get("prefill_tokens") or cfg.max_tokens]
        metrics.update(
            measure_speed(
                model,
                prompt,
                lambda: build_cache(policy, model),
                cfg.decode_tokens,
                repeats=cfg.speed_repeats,
                progress=cfg.get("progress", True),
                after_prefill=after_prefill(model, tokenizer),
            )
        )
    metrics["peak_rss_bytes"] = peak_rss_bytes()
    metrics["peak_device_bytes"] = peak_device_bytes(model.device)
    return metrics
