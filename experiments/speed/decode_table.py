"""Decode speed by policy and storage at 512, 4096 and 8000 tokens (the three decode targets), in one process.

Each cache is prefilled once per length (kvzip's context pass included) and that state is kept. Then, after
``--warmup`` untimed rounds, ``--repeats`` rounds in which every cache in turn is restored to its state,
decodes one untimed token (a restored copy re-owns its buffers there) and then ``--decode-tokens`` greedy
tokens, timed by the wall clock and by this process's CPU time; the order rotates by one cache a round.
Ratios are taken within a round, by CPU time (``vs_full``: tokens per CPU second over ``full``'s in the same
round; ``wall_vs_*`` by wall time); every number is a median over the rounds with its interquartile range.

``kvcompress bench`` times the same decode loop, but prefills again for every measurement (minutes per cache
at 8000 tokens on a shared 2-core machine) and names each package policy once per process, so h2o over dense
and over int4 cannot run side by side there, nor ``full_half`` (``full`` prefilled with the first half of the
prompt: what a selector at ratio 0.5 reads, with no scoring: the bound on any of them).

Usage: python experiments/speed/decode_table.py --out DIR [--lengths 512 4096 8000] [--decode-tokens 32]
       [--warmup 1] [--repeats 5] [--caches NAME ...]   (DIR/results.json: metrics.rows, config, environment)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

from kvcompress import build_cache, load_model
from kvcompress.core import attention
from kvcompress.core.cache import KVCache, held_bytes, peer_cache
from kvcompress.core.profiling import timing
from kvcompress.harness.results import code_version, environment
from kvcompress.harness.tasks.perplexity import text_tokens
from kvcompress.metrics.stats import median_iqr
from kvcompress.resources.files import write_json_atomic
from kvcompress.runtime.context_pass import after_prefill, forward_prompt

# decode-time eviction (h2o) over int4 needs per-token key groups; quant refuses per-channel ones there
INT4_TOKEN_KEYS = {"name": "quant", "key_axis": "token"}
CACHES = {  # name -> (policy, fields); "dynamic" is transformers' DynamicCache with the model's own attention
    "dynamic": ("dynamic", {}),
    "full": ("full", {}),
    "full_half": ("full", {}),  # prefilled with the first half of the prompt only
    "quant": ("quant", {}),  # int4 at quant's defaults: keys per channel, the C++ kernel on a CPU
    **{f"{p}_0.5": (p, {"compression_ratio": 0.5}) for p in ("h2o", "snapkv", "kvzip")},
    "h2o_0.5_int4": ("h2o", {"compression_ratio": 0.5, "storage": INT4_TOKEN_KEYS}),
    **{f"{p}_0.5_int4": (p, {"compression_ratio": 0.5, "storage": "quant"}) for p in ("snapkv", "kvzip")},
}  # fmt: skip
REFERENCES = ("full", "full_half", "quant", "dynamic")  # the vs_<name> columns


def use_attention(model, cache) -> None:
    """The model's own attention for DynamicCache (as a transformers user runs it), kvcompress's otherwise."""
    if isinstance(cache, KVCache):
        attention.install(model, hidden=any(layer.wants_hidden for layer in cache.layers))
    else:
        attention.uninstall(model)


@torch.inference_mode()
def prefill(model, tokenizer, ids, name: str) -> dict:
    """A cache after the prompt (and its context pass): a snapshot to restore, the next token, seconds."""
    policy, fields = CACHES[name]
    ids = ids[:, : ids.shape[1] // 2] if name == "full_half" else ids
    cache = peer_cache("dynamic", model) if policy == "dynamic" else build_cache(policy, model, **fields)
    use_attention(model, cache)
    t0 = time.perf_counter()
    logits = forward_prompt(model, cache, ids, logits_to_keep=1).logits
    after_prefill(model, tokenizer)(cache, ids)
    seconds = time.perf_counter() - t0
    snap = cache.snapshot() if isinstance(cache, KVCache) else cache
    return {"snap": snap, "next": logits[:, -1:].argmax(-1), "prefill_s": seconds, "bytes": held_bytes(cache)}


@torch.inference_mode()
def decode(model, state: dict, tokens: int) -> dict:
    """One untimed step, then ``tokens`` timed greedy steps, from a copy of the cache's post-prompt state."""
    snap = state["snap"]
    cache = snap.snapshot() if isinstance(snap, KVCache) else copy.deepcopy(snap)
    use_attention(model, cache)
    nxt = model(state["next"], cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    with timing() as timer:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(tokens):
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "policy_s": timer.seconds}


def rounds(model, states: dict, args) -> dict:
    """name -> the timed runs, ``args.warmup`` untimed rounds first; the order rotates each round."""
    names, runs = list(states), {name: [] for name in states}
    for r in range(args.warmup + args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run = decode(model, states[name], args.decode_tokens)
            if r >= args.warmup:
                runs[name].append(run)
    return runs


def with_iqr(row: dict, key: str, values: list[float]) -> None:
    stats = median_iqr(values)
    row.update({key: stats["median"], f"{key}_q1": stats["q1"], f"{key}_q3": stats["q3"]})


def summarise(length: int, states: dict, runs: dict, tokens: int) -> list[dict]:
    """One row per cache: tok/s (wall, CPU) and per-round ratios to each reference present, medians + IQRs."""
    rows = []
    for name, mine in runs.items():
        row = {"cache": name, "context": length}
        with_iqr(row, "decode_tok_s", [tokens / r["wall_s"] for r in mine])
        with_iqr(row, "cpu_tok_s", [tokens / r["cpu_s"] for r in mine])
        for ref in (r for r in REFERENCES if r in runs):
            for clock, prefix in (("cpu_s", ""), ("wall_s", "wall_")):
                ratios = [b[clock] / a[clock] for a, b in zip(mine, runs[ref], strict=True)]
                with_iqr(row, f"{prefix}vs_{ref}", ratios)
        row["policy_overhead"] = median_iqr([r["policy_s"] / r["wall_s"] for r in mine])["median"]
        row["cache_mib"] = states[name]["bytes"] / 2**20
        row["prefill_s"] = states[name]["prefill_s"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 8000])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    model, tokenizer = load_model("smollm2-135m", dtype="float32", device="cpu")
    ids = text_tokens(tokenizer, "pg_essays", max(args.lengths), 0, model.config.max_position_embeddings)
    env = {"environment": environment(model), "load_before": os.getloadavg(), "t0": time.perf_counter()}
    rows = []
    for i, length in enumerate(args.lengths):
        states = {name: prefill(model, tokenizer, ids[:, :length], name) for name in args.caches}
        rows += summarise(length, states, rounds(model, states, args), args.decode_tokens)
        del states
        seconds = time.perf_counter() - env["t0"]
        print(f"{length} tokens done after {seconds:.0f} s", file=sys.stderr, flush=True)
        write(args, argv, rows, env, done=i == len(args.lengths) - 1)
    return 0


def write(args, argv, rows: list, env: dict, done: bool) -> None:
    """The record so far (``status: partial`` until the last length is done)."""
    record = {
        "status": "ok" if done else "partial",
        "config": {**vars(args), "model": "smollm2-135m", "dtype": "float32", "text": "pg_essays",
                   "caches": {name: CACHES[name] for name in args.caches}},
        "command": " ".join(["python experiments/speed/decode_table.py", *(argv or sys.argv[1:])]),
        "code_version": code_version(), "environment": env["environment"],
        "load_average": {"before": env["load_before"], "after": os.getloadavg()},
        "wall_s": time.perf_counter() - env["t0"], "metrics": {"rows": rows},
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    write_json_atomic(os.path.join(args.out, "results.json"), record)


if __name__ == "__main__":
    sys.exit(main())
