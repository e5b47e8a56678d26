"""Decode-mode perplexity, cache memory and speed of one policy on the first ``max_tokens`` of a text."""

from __future__ import annotations

import time

import torch

from kvcompress.cache import build_cache
from kvcompress.data import load_text
from kvcompress.guard import check_fits
from kvcompress.metrics import decode_perplexity, measure_speed, peak_rss_bytes
from kvcompress.metrics.memory import peak_device_bytes, read_summary


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


def run(model, tokenizer, policy, cfg) -> dict:
    """Perplexity (decode mode), bytes vs ``full`` on the same tokens, prefill/decode speed."""
    spec_max = getattr(model.config, "max_position_embeddings", 0)
    ids = text_tokens(tokenizer, cfg.text, cfg.max_tokens, cfg.get("offset_tokens", 0), spec_max)
    check_fits(model, cfg.max_tokens, chunk=cfg.chunk_size)
    start = time.perf_counter()
    cache = build_cache(policy, model)  # includes a calibrating policy's calibration (or its reload)
    build_s = time.perf_counter() - start
    metrics = decode_perplexity(
        model, ids, cache, chunk_size=cfg.chunk_size, progress=cfg.get("progress", True)
    )
    metrics["build_cache_s"] = build_s
    metrics["cache_bytes"] = cache.memory_bytes()
    metrics["tokens_stored_mean"] = sum(s["tokens_stored"] for s in cache.stats()) / len(cache.layers)
    metrics.update(read_summary(cache.stats()))  # block_sparse: bytes read per decode step
    with torch.inference_mode():  # the full cache over the same tokens, for the ratio
        baseline = build_cache("full", model)
        model(ids[:, :-1].to(model.device), cache=baseline, use_cache=True, logits_to_keep=1)
    metrics["full_cache_bytes"] = baseline.memory_bytes()
    metrics["cache_ratio"] = metrics["cache_bytes"] / metrics["full_cache_bytes"]
    del cache, baseline
    if cfg.get("speed", True):
        prompt = ids[:, : cfg.get("prefill_tokens") or cfg.max_tokens]
        metrics.update(
            measure_speed(
                model,
                prompt,
                lambda: build_cache(policy, model),
                cfg.decode_tokens,
                repeats=cfg.speed_repeats,
                progress=cfg.get("progress", True),
            )
        )
    metrics["peak_rss_bytes"] = peak_rss_bytes()
    metrics["peak_device_bytes"] = peak_device_bytes(model.device)
    return metrics
