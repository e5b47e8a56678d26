"""KVzap's surrogates on the embedded default: their fit (held-out documents) and their prefill cost.

1. Trains both surrogates as ``policy=kvzap`` does at its defaults (or loads them: the artifact is saved
   beside the low-rank calibrations) and records the held-out fit of each (linear, mlp): R^2 of the log
   KVzip+ score and Pearson's r, per layer and their mean, and the share of the true KVzip+ ranking's kept
   set that the predicted ranking keeps at compression ratios 0.75 and 0.9.
2. Times the prefill of one essay slice, ``--rounds`` rounds interleaved over: ``full`` (a plain prefill),
   ``kvzap`` (mlp) at 0.75 (the prefill, scoring and eviction inside it) and ``kvzip`` at 0.75 (the prefill
   and its context pass, ``prefill``). Medians with their interquartile range, and each against ``full``.

Record: ``experiments/kvzap/runs/main.json`` (atomic). One thread:

    OMP_NUM_THREADS=1 .venv/bin/python experiments/kvzap/run.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvcompress import build_cache, load_model
from kvcompress.harness.results import environment
from kvcompress.metrics.stats import median_iqr
from kvcompress.resources.data import load_text
from kvcompress.resources.files import write_json_atomic
from kvcompress.runtime.context_pass import prefill
from kvcompress.selectors.eviction import kvzap_fit

HERE = Path(__file__).resolve().parent
POLICIES = {"full": {}, "kvzap": {"compression_ratio": 0.75}, "kvzip": {"compression_ratio": 0.75}}


@torch.inference_mode()
def prefill_seconds(model, tok, ids, name: str) -> float:
    cache = build_cache(name, model, **POLICIES[name])
    start = time.perf_counter()
    prefill(model, cache, ids, tok, logits_to_keep=1)
    seconds = time.perf_counter() - start
    if name != "full":
        assert all(layer.stored_length() < ids.shape[1] for layer in cache.layers), f"{name} did not compress"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model, tok = load_model()
    build_cache("kvzap", model)  # fits the scorer, or loads it
    found = next(iter(kvzap_fit._MEMO.values()))
    fit = {k: v for k, v in found.items() if k not in ("linear", "mlp", "ident")}
    ids = tok(load_text(), return_tensors="pt").input_ids[:, : args.tokens]
    times = {name: [] for name in POLICIES}
    for name in POLICIES:  # warm-up
        prefill_seconds(model, tok, ids, name)
    for _ in range(args.rounds):
        for name in POLICIES:
            times[name].append(prefill_seconds(model, tok, ids, name))
    full = median_iqr(times["full"])["median"]
    cost = {name: {**median_iqr(t), "vs_full": median_iqr(t)["median"] / full, "seconds": t}
            for name, t in times.items()}  # fmt: skip
    record = {"args": vars(args), "fit": fit, "prefill": cost, "environment": environment()}
    write_json_atomic(HERE / "runs" / "main.json", record)
    for kind, got in fit["fit"].items():
        print(kind, {k: round(v, 4) for k, v in got.items() if isinstance(v, float)})
    print(
        f"fit: {fit['train_pairs']} pairs from {fit['documents'] - fit['holdout']} documents of "
        f"{fit['tokens']} tokens, {fit['holdout']} held out, {fit['seconds']} s ({fit['source']})"
    )
    for name, c in cost.items():
        spread = f"IQR {c['q1']:.3f}-{c['q3']:.3f}"
        print(f"{name}: prefill {c['median']:.3f} s ({spread}), {c['vs_full']:.2f}x full")


if __name__ == "__main__":
    main()
