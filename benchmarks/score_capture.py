"""Prefill cost of attention-score capture: eviction policies vs plain SDPA on the same prompt.

Runs are interleaved (one of each configuration per round, after a warm-up round) so that load from
other processes hits all of them alike; prints the median prefill seconds and the ratio to plain SDPA
(the model's own ``sdpa`` attention with a ``DynamicCache``, no kvcompress hook).

Usage: python benchmarks/score_capture.py [--tokens 2048] [--repeats 7] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from kvcompress import build_cache, load_model, load_text
from kvcompress.harness.report import markdown_table

POLICIES = {
    "full (hook, no scores)": ("full", {}),
    "snapkv ratio 0.5": ("snapkv", {}),
    "pyramidkv ratio 0.5": ("pyramidkv", {}),
    "h2o ratio 0.5": ("h2o", {}),
    "tova ratio 0.5": ("tova", {}),
}


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill_seconds(model, ids, make_cache, attn: str) -> float:
    model.set_attn_implementation(attn)
    cache = make_cache()
    _sync(model.device)
    start = time.perf_counter()
    model(ids, cache=cache, use_cache=True)
    _sync(model.device)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    model, tok = load_model(device=args.device)
    ids = tok(load_text("pg_essays")[: args.tokens * 8], return_tensors="pt").input_ids[:, : args.tokens]
    ids = ids.to(model.device)
    build_cache("full", model)  # registers the kvcompress attention function
    configs = {"plain sdpa (DynamicCache)": (lambda: DynamicCache(config=model.config), "sdpa")}
    for label, (name, kw) in POLICIES.items():
        configs[label] = (lambda name=name, kw=kw: build_cache(name, model, **kw), "kvcompress")
    times = {label: [] for label in configs}
    for round_ in range(args.repeats + 1):  # round 0 is the warm-up
        for label, (make_cache, attn) in configs.items():
            seconds = prefill_seconds(model, ids, make_cache, attn)
            if round_:
                times[label].append(seconds)
    base = statistics.median(times["plain sdpa (DynamicCache)"])
    rows = [
        {
            "config": label,
            "prefill_s": statistics.median(t),
            "ratio_to_plain_sdpa": statistics.median(t) / base,
        }
        for label, t in times.items()
    ]
    print(f"prefill of {ids.shape[1]} tokens on {model.device}, median of {args.repeats} interleaved runs")
    print(markdown_table(rows, ["config", "prefill_s", "ratio_to_plain_sdpa"]))


if __name__ == "__main__":
    main()
