"""Prefill cost of KVzip's context pass, stage by stage, against a plain prefill of the same prompt.

One round times a plain prefill (policy ``full``), snapkv's prefill, and kvzip's prefill followed by its
context pass (``compress_context``); rounds are interleaved after a warm-up round, so load from other
processes hits all of them alike. The pass is split by timing, from outside, the functions it calls:
the attention of the reconstruction forwards (the backend's ``run``), the rest of those forwards
(projections, MLP, norms, the cache hook), the score capture (``KVzipLayer.observe_attention``), the
planning (``kvzip_budgets.plan``) and the eviction (``end_pass``). Prints the median ms of each
stage and its ratio to the plain prefill; ``kept_sha`` hashes the token indices every layer keeps, so two
records with the same hash kept the same tokens.

Usage: python benchmarks/kvzip_prefill.py [--tokens 2048] [--repeats 5] [--threads 1] [--ratio 0.5]
       [--out DIR --label NAME]   (DIR/results.json: the rows, named NAME, and the environment)
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from kvcompress import build_cache, load_model, load_text
from kvcompress.core import executor
from kvcompress.core.profiling import sync_device
from kvcompress.harness.report import markdown_table
from kvcompress.harness.results import code_version, environment
from kvcompress.resources.files import write_json_atomic
from kvcompress.runtime.context_pass import compress_context
from kvcompress.selectors.eviction import kvzip_budgets
from kvcompress.selectors.eviction.kvzip import KVzipLayer

PASS_STAGES = ("pass: attention", "pass: other forward compute", "pass: score capture", "pass: planning",
               "pass: eviction")  # fmt: skip


class Clock:
    """Seconds per stage of one run; ``wrap`` times a function (synchronising a device) while ``on``."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self.kept: list[torch.Tensor] = []

    def wrap(self, fn, stage: str):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            sync_device()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync_device()
            self.seconds[stage] += time.perf_counter() - start
            return out

        return timed


def instrument(clock: Clock) -> None:
    """Time the pass's stages from outside: the attention backends, the score hook, plan and eviction."""
    for backend in executor.BACKENDS:
        backend.run = clock.wrap(backend.run, "pass: attention")
    KVzipLayer.observe_pass = clock.wrap(KVzipLayer.observe_pass, "pass: score capture")
    KVzipLayer.end_pass = clock.wrap(KVzipLayer.end_pass, "pass: eviction")
    kvzip_budgets.plan = clock.wrap(kvzip_budgets.plan, "pass: planning")
    select = KVzipLayer.select

    def recorded(self, *args, **kwargs):
        idx = select(self, *args, **kwargs)
        clock.kept.append(idx.cpu())
        return idx

    KVzipLayer.select = recorded


@torch.inference_mode()
def one_round(model, tok, ids, clock: Clock, ratio: float) -> dict[str, float]:
    """Seconds of each stage in one round (the plain prefill first)."""
    out = {}
    for label, name, kw in (("plain prefill (full)", "full", {}),
                            ("snapkv prefill", "snapkv", {"compression_ratio": ratio}),
                            ("kvzip prefill", "kvzip", {"compression_ratio": ratio})):  # fmt: skip
        cache = build_cache(name, model, **kw)
        sync_device()
        start = time.perf_counter()
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        sync_device()
        out[label] = time.perf_counter() - start
    clock.seconds.clear()
    clock.kept.clear()
    clock.on = True
    start = time.perf_counter()
    compress_context(model, cache, ids, tok)
    sync_device()
    total = time.perf_counter() - start
    clock.on = False
    stages = dict(clock.seconds)
    stages["pass: other forward compute"] = total - sum(stages.values())
    out |= {stage: stages.get(stage, 0.0) for stage in PASS_STAGES}
    out["context pass (total)"] = total
    out["kvzip prefill + pass"] = out["kvzip prefill"] + total
    return out


def kept_sha(kept: list[torch.Tensor]) -> str:
    digest = hashlib.sha1()
    for idx in kept:
        digest.update(idx.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=0.5, help="compression_ratio of snapkv and kvzip")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, help="write DIR/results.json")
    parser.add_argument("--label", default="", help="names the record's rows in a table of several records")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(device=args.device, dtype="float32")
    ids = tok(load_text("pg_essays")[: args.tokens * 8], return_tensors="pt").input_ids[:, : args.tokens]
    ids = ids.to(model.device)
    clock = Clock()
    instrument(clock)
    times = defaultdict(list)
    for round_ in range(args.repeats + 1):  # round 0 is the warm-up
        for stage, seconds in one_round(model, tok, ids, clock, args.ratio).items():
            if round_:
                times[stage].append(seconds)
    base = statistics.median(times["plain prefill (full)"])
    rows = [
        {
            "stage": stage,
            "ms": 1e3 * statistics.median(t),
            "ms_q1": 1e3 * statistics.quantiles(t, n=4)[0] if len(t) > 1 else None,
            "ms_q3": 1e3 * statistics.quantiles(t, n=4)[2] if len(t) > 1 else None,
            "vs_plain_prefill": statistics.median(t) / base,
        }
        for stage, t in times.items()
    ]
    sha = kept_sha(clock.kept)
    print(
        f"{ids.shape[1]} tokens, {model.device}, {model.dtype}, {torch.get_num_threads()} threads, median of "
        f"{args.repeats} interleaved rounds; kept_sha {sha} (ratio {args.ratio})"
    )
    print(markdown_table(rows, ["stage", "ms", "ms_q1", "ms_q3", "vs_plain_prefill"]))
    if args.out:
        record = {
            "status": "ok",
            "config": {"tokens": ids.shape[1], "repeats": args.repeats, "threads": args.threads,
                       "compression_ratio": args.ratio, "text": "pg_essays", "model": "smollm2-135m"},
            "command": " ".join(["python", "benchmarks/kvzip_prefill.py", *(argv or sys.argv[1:])]),
            "code_version": code_version(),
            "environment": environment(model),
            "metrics": {"rows": [{"code": args.label, **row, "kept_sha": sha} for row in rows]},
        }  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.out / "results.json", record)


if __name__ == "__main__":
    main()
