"""Decode speed of policies relative to the first one, measured interleaved in one process (a busy machine).

Usage: python scripts/bench_decode.py full block_sparse:read_ratio=0.25 low_rank:rank=32 [--prompt 1024]

Each round runs every policy once (prefill the prompt, then ``--decode`` greedy steps) after one warm-up
round; the median decode time per policy is reported with its ratio to the first policy.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import yaml

from kvcompress import build_cache, load_model, load_text
from kvcompress.metrics import measure_speed


def parse_policy(spec: str) -> tuple[str, dict]:
    """``name:field=value,field=value`` (values parsed as YAML scalars)."""
    name, _, rest = spec.partition(":")
    params = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, {k: yaml.safe_load(v) for k, v in params.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policies", nargs="+", help="name[:field=value,...]; the first one is the reference")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the essays")
    parser.add_argument("--decode", type=int, default=32, help="greedy decode steps after the prompt")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model, tok = load_model()
    ids = tok(load_text()[:40000], return_tensors="pt").input_ids[:, : args.prompt]
    specs = [parse_policy(p) for p in args.policies]
    times: dict[str, list[float]] = {p: [] for p in args.policies}
    for r in range(args.rounds + 1):  # round 0 is the warm-up
        for label, (name, params) in zip(args.policies, specs, strict=True):
            make = lambda n=name, p=params: build_cache(n, model, **p)  # noqa: E731
            speed = measure_speed(model, ids, make, args.decode, warmup=0, repeats=1)
            if r:
                times[label].append(args.decode / speed["decode_tok_s"])
    ref = statistics.median(times[args.policies[0]])
    print("| policy | decode_tok_s | decode_time_ratio |\n|---|---|---|")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"| {label} | {args.decode / med:.2f} | {med / ref:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
