"""Time to first token and decode tokens/s with a hand-written greedy loop, after warm-up."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from kvcompress.metrics.stats import median_iqr
from kvcompress.runtime.context_pass import forward_prompt


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _one_run(model, input_ids, make_cache, decode_tokens: int, after_prefill=None):
    cache = make_cache()
    _sync(model.device)
    t0 = time.perf_counter()
    logits = forward_prompt(model, cache, input_ids, logits_to_keep=1).logits  # in chunks if it asks
    if after_prefill is not None:  # a query-agnostic policy's context pass is part of its prefill
        after_prefill(cache, input_ids)
    _sync(model.device)
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        nxt = logits.argmax(-1)  # (B, 1)
        logits = model(nxt, cache=cache, use_cache=True).logits[:, -1:]
    _sync(model.device)
    return t1 - t0, time.perf_counter() - t1, cache


def measure_speed(
    model, input_ids, make_cache, decode_tokens: int = 32, warmup: int = 1, repeats: int = 3, progress=True,
    after_prefill=None,
):  # fmt: skip
    """Median prefill seconds, prefill and decode tokens/s with their interquartile range (``*_q1``,
    ``*_q3``) over ``repeats`` runs after ``warmup`` runs.

    Args:
        input_ids: prompt (B, P) on the model's device.
        make_cache: callable returning a fresh cache for each run.
        after_prefill: ``after_prefill(cache, input_ids)``, timed as part of the prefill (a context pass).
    """
    prefill, decode = [], []
    for i in tqdm(range(warmup + repeats), desc="speed", disable=not progress, leave=False):
        p, d, cache = _one_run(model, input_ids.to(model.device), make_cache, decode_tokens, after_prefill)
        if i >= warmup:
            prefill.append(p)
            decode.append(d)
    n, p, d = input_ids.shape[0], median_iqr(prefill), median_iqr(decode)
    prefill_rate = lambda s: n * input_ids.shape[1] / s  # noqa: E731
    decode_rate = lambda s: n * decode_tokens / s if decode_tokens else float("nan")  # noqa: E731
    return {
        "prompt_tokens": input_ids.shape[1],
        "prefill_s": p["median"],
        "prefill_tok_s": prefill_rate(p["median"]),
        "prefill_tok_s_q1": prefill_rate(p["q3"]),  # the slower quartile of times is the lower rate
        "prefill_tok_s_q3": prefill_rate(p["q1"]),
        "decode_tok_s": decode_rate(d["median"]),
        "decode_tok_s_q1": decode_rate(d["q3"]),
        "decode_tok_s_q3": decode_rate(d["q1"]),
        "decode_tokens": decode_tokens,
        "speed_repeats": repeats,
        "cache_bytes_after_decode": cache.memory_bytes() if hasattr(cache, "memory_bytes") else None,
    }
