"""Benchmark every policy (and transformers' own caches) across context lengths, interleaved in one
process after warm-up: time to first token, decode tokens/s, per-step policy overhead, cache bytes.

Absolute times drift on shared machines, so the table reports ratios to ``full`` measured in the
same run (medians over ``repeats``).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from kvcompress.core import attention
from kvcompress.core.cache import PEERS, build_cache, held_bytes, known_policies, make_policy, peer_cache
from kvcompress.core.profiling import timing
from kvcompress.harness.guard import check_fits
from kvcompress.harness.report import markdown_table
from kvcompress.harness.tasks.perplexity import text_tokens
from kvcompress.memory_model import predicted_for_model
from kvcompress.metrics.compression import attention_backends, read_ratio
from kvcompress.metrics.memory import peak_device_bytes, peak_rss_bytes, tier_summary
from kvcompress.metrics.speed import _sync
from kvcompress.metrics.stats import median_iqr
from kvcompress.runtime.context_pass import after_prefill, forward_prompt

BENCH_COLUMNS = [
    "cache", "context", "ttft_s", "decode_tok_s", "policy_overhead", "cache_bytes",
    "ttft_vs_full", "decode_vs_full", "decode_vs_dynamic", "bytes_vs_full", "read_ratio", "bytes_vs_dynamic",
    "predicted_bytes", "bytes_vs_predicted", "peak_rss_mb", "peak_device_mb",
]  # fmt: skip
SCALING_COLUMNS = ["cache", "decode_ms_per_token_at_1k", "decode_ms_per_1k_context", "fit_points"]
TIER_COLUMNS = [
    "host_bytes",
    "disk_bytes",
    "bytes_fetched_per_step",
    "pages_fetched_per_step",
    "lru_hit_rate",
]


def _contenders(cfg) -> dict:
    """name -> (make_cache, uses_kvcompress_attention)."""
    names = list(cfg.get("policies") or known_policies())
    overrides = cfg.get("policy_overrides") or {}
    out = {name: make_policy(name, **dict(overrides.get(name, {}))) for name in names}
    if "full" not in out:
        out = {"full": make_policy("full"), **out}
    for peer in cfg.get("peers") or []:
        if peer not in PEERS:
            raise ValueError(f"task.peers: {peer!r} is unknown; known: {list(PEERS)}")
        out[peer] = peer
    return out


def _make(model, contender, window: int):
    if isinstance(contender, str):
        model.set_attn_implementation(model.config.kvcompress_backend)
        return peer_cache(contender, model, window=window)
    attention.install(model)
    return build_cache(contender, model)


@torch.inference_mode()
def _measure(model, ids, cache, decode_tokens: int, after=None) -> dict:
    """One prefill (with a query-agnostic policy's context pass, ``after``) + ``decode_tokens`` greedy
    steps; seconds and policy seconds during decode."""
    if str(model.device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(model.device)  # each row's own device peak
    _sync(model.device)
    t0 = time.perf_counter()
    logits = forward_prompt(model, cache, ids, logits_to_keep=1).logits
    if after is not None:
        after(cache, ids)
    _sync(model.device)
    ttft = time.perf_counter() - t0
    with timing() as timer:
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            logits = model(logits.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
        _sync(model.device)
        decode = time.perf_counter() - t1
    tiers = tier_summary(cache.stats()) if hasattr(cache, "stats") else {}
    return {
        "ttft_s": ttft, "decode_s": decode, "policy_s": timer.seconds, "bytes": held_bytes(cache),
        "peak_rss": peak_rss_bytes(), "peak_device": peak_device_bytes(model.device) or 0, **tiers,
        "read_ratio": read_ratio(cache),  # the same in every repeat; None for transformers' caches
        "attention_backends": attention_backends(cache),  # {} for transformers' caches
    }  # fmt: skip


def _summarise(samples: dict, decode_tokens: int) -> list[dict]:
    rows = []
    for (name, length), runs in samples.items():
        once = ("read_ratio", "attention_backends")  # the same in every repeat
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in once}
        ttft, dec = median_iqr([r["ttft_s"] for r in runs]), median_iqr([r["decode_s"] for r in runs])
        rows.append(
            {
                "cache": name,
                "context": length,
                "ttft_s": med["ttft_s"],
                "ttft_s_q1": ttft["q1"],
                "ttft_s_q3": ttft["q3"],
                "decode_tok_s": decode_tokens / med["decode_s"],
                "decode_tok_s_q1": decode_tokens / dec["q3"],  # slower times, lower rate
                "decode_tok_s_q3": decode_tokens / dec["q1"],
                "policy_overhead": med["policy_s"] / med["decode_s"],
                "cache_bytes": int(med["bytes"]),
                "read_ratio": runs[0]["read_ratio"],
                "attention_backends": runs[0]["attention_backends"],
                "peak_rss_mb": max(r["peak_rss"] for r in runs) / 2**20,  # the process's, up to this point
                "peak_device_mb": max(r["peak_device"] for r in runs) / 2**20 or None,
                **{k: med[k] for k in TIER_COLUMNS if k in med},  # tiered: per tier, fetches, hit rate
            }
        )
    for row in rows:
        _ratios(row, rows, "full")
        _ratios(row, rows, "dynamic")
    return sorted(rows, key=lambda r: (r["context"], r["cache"] != "full", r["cache"]))


def _ratios(row: dict, rows: list[dict], ref_name: str) -> None:
    """``*_vs_<ref_name>`` columns against that cache at the same context (None where it did not run)."""
    ref = next((r for r in rows if r["cache"] == ref_name and r["context"] == row["context"]), None)
    names = {"ttft_s": "ttft", "decode_tok_s": "decode", "cache_bytes": "bytes"}
    for key, short in names.items():
        if ref_name == "full" or key != "ttft_s":
            row[f"{short}_vs_{ref_name}"] = None if ref is None else row[key] / ref[key]


def scaling(rows: list[dict]) -> list[dict]:
    """Least-squares line of decode ms per token over context (in thousands of tokens), per cache: the
    slope says what each 1k tokens of context adds to a decode step."""
    out = []
    for name in dict.fromkeys(r["cache"] for r in rows):
        pts = [(r["context"] / 1000, 1000 / r["decode_tok_s"]) for r in rows if r["cache"] == name]
        if len(pts) < 2:
            continue
        xm, ym = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
        slope = sum((x - xm) * (y - ym) for x, y in pts) / sum((x - xm) ** 2 for x, _ in pts)
        out.append(
            {"cache": name, "decode_ms_per_token_at_1k": ym + slope * (1 - xm),
             "decode_ms_per_1k_context": slope, "fit_points": len(pts)}
        )  # fmt: skip
    return out


def _add_predictions(rows: list[dict], contenders: dict, model, decode_tokens: int) -> None:
    """The memory model's bytes for each row's policy at its context and decode tokens (``predicted_bytes``)
    and measured / predicted (``bytes_vs_predicted``); None for transformers' caches and unknown policies."""
    for row in rows:
        policy, pred = contenders[row["cache"]], None
        if not isinstance(policy, str):  # a peer cache is named by a string
            pred = predicted_for_model(policy, model, row["context"], decode_tokens)
        row["predicted_bytes"] = pred
        row["bytes_vs_predicted"] = row["cache_bytes"] / pred if pred else None


def run(model, tokenizer, policy, cfg) -> dict:
    """Interleaved benchmark over ``cfg.lengths`` x contenders; returns rows and the process peak RSS."""
    attention.install(model)
    contenders = _contenders(cfg)
    lengths = list(cfg.lengths)
    ids = text_tokens(
        tokenizer, cfg.text, max(lengths), 0, getattr(model.config, "max_position_embeddings", 0)
    )
    ids = ids.to(model.device)
    check_fits(model, max(lengths))
    samples = defaultdict(list)
    rounds = [(r, n, c) for r in range(cfg.warmup + cfg.repeats) for n in lengths for c in contenders]
    for rep, length, name in tqdm(rounds, desc="bench", disable=not cfg.get("progress", True)):
        cache = _make(model, contenders[name], cfg.get("peer_window", 256))
        result = _measure(model, ids[:, :length], cache, cfg.decode_tokens, after_prefill(model, tokenizer))
        if rep >= cfg.warmup:
            samples[(name, length)].append(result)
        del cache
    attention.install(model)
    rows = _summarise(samples, cfg.decode_tokens)
    _add_predictions(rows, contenders, model, cfg.decode_tokens)
    fits = scaling(rows)
    tiered = TIER_COLUMNS if any("lru_hit_rate" in r for r in rows) else []
    print(markdown_table(rows, BENCH_COLUMNS + tiered))
    print(markdown_table(fits, SCALING_COLUMNS))
    return {
        "rows": rows,
        "scaling": fits,
        "peak_rss_bytes": peak_rss_bytes(),
        "decode_tokens": cfg.decode_tokens,
    }
