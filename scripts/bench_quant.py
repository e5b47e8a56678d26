"""Side-by-side of quantized KV caches on the embedded default: kvcompress ``quant`` vs transformers' own.

One process, one table. Every row streams the same tokens of the essays through its cache in decode mode
(``chunk_size`` recorded per row), then reports the cache's bytes, its effective bits per quantized element
(codes + scales + zero points, residual window excluded) and, measured interleaved across rows by
continuing each row's filled cache, decode tokens/s. Ratios are against ``full``.

transformers' ``QuantizedCache`` rows run with the model's plain SDPA attention (our attention hook is
switched off for them); kvcompress rows run through our registered attention function.

Perplexity is exp of the mean NLL over ``--slices`` disjoint slices of ``--tokens`` tokens with a 95% interval
on that log scale (each slice kept in the record); decode speed is the median with its interquartile range.

Usage: python scripts/bench_quant.py [--tokens 2048] [--slices 3] [--grid-chunk 16] [--threads 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_quant_rows import Row, cache_size, rows, set_mode
from omegaconf import OmegaConf

from kvcompress import load_model
from kvcompress.harness.report import markdown_table
from kvcompress.harness.results import environment
from kvcompress.harness.tasks.slices import combine_slices, slice_ids, slice_starts
from kvcompress.metrics import decode_perplexity
from kvcompress.metrics.stats import median_iqr
from kvcompress.resources.data import load_text
from kvcompress.resources.files import write_json_atomic

COLUMNS = [
    "row", "chunk_size", "perplexity", "ppl_vs_full", "cache_bytes", "bytes_vs_full", "bits_quantized",
    "bits_all", "decode_tok_s", "speed_vs_full", "status",
]  # fmt: skip


def perplexity_row(model, pieces, row: Row) -> tuple[dict, object]:
    """Decode-mode perplexity of one row over the text slices (``combine_slices``, each slice kept);
    returns its record and the first slice's filled cache (for the speed phase)."""
    record = {"row": row.name, "kind": row.kind, "params": row.params, "chunk_size": row.chunk}
    try:
        set_mode(model, row.kind)
        per_slice, first = [], None
        start = time.perf_counter()
        for ids in pieces:
            cache = row.make(model)
            per_slice.append(decode_perplexity(model, ids, cache, chunk_size=row.chunk, progress=False))
            first = cache if first is None else first
        combined = combine_slices(per_slice)
        record.update({k: v for k, v in combined.items() if k not in ("compressed", "warning")})
        record.update(cache_size(first, model), perplexity_s=time.perf_counter() - start, status="ok")
        return record, first
    except Exception as err:  # an unavailable backend is a result too: say what happened
        record["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return record, None


@torch.inference_mode()
def decode_seconds(model, row: Row, cache, steps: int) -> float:
    """Greedy decode ``steps`` tokens continuing ``cache``; seconds per token."""
    set_mode(model, row.kind)
    nxt = torch.tensor([[row.last_token]], device=model.device)
    start = time.perf_counter()
    for _ in range(steps):
        nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    if str(model.device).startswith("cuda"):
        torch.cuda.synchronize(model.device)
    row.last_token = int(nxt)
    return (time.perf_counter() - start) / steps


def speed_phase(model, done: list[tuple[Row, dict, object]], steps: int, repeats: int) -> None:
    """Decode tokens/s per row: one warm-up step each, then ``repeats`` rounds interleaved over rows."""
    live = [(row, rec, cache) for row, rec, cache in done if cache is not None]
    for row, _, cache in live:
        decode_seconds(model, row, cache, 1)
    times = {row.name: [] for row, _, _ in live}
    for _ in range(repeats):
        for row, _, cache in live:
            times[row.name].append(decode_seconds(model, row, cache, steps))
    for row, rec, _ in live:
        spread = median_iqr(times[row.name])  # seconds per token: the slower quartile is the lower rate
        rec.update(decode_tok_s=1.0 / spread["median"], decode_tok_s_q1=1.0 / spread["q3"])
        rec.update(decode_tok_s_q3=1.0 / spread["q1"], decode_steps=steps, decode_repeats=repeats)
        rec["decode_context"] = rec["slices"][0]["tokens_scored"] + 1


def add_ratios(records: list[dict]) -> None:
    full = next(r for r in records if r["row"] == "full")
    for r in records:
        if r["status"] != "ok":
            continue
        r["ppl_vs_full"] = r["perplexity"] / full["perplexity"]
        r["bytes_vs_full"] = r["cache_bytes"] / full["cache_bytes"]
        if "decode_tok_s" in r and "decode_tok_s" in full:
            r["speed_vs_full"] = r["decode_tok_s"] / full["decode_tok_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the essays per slice")
    parser.add_argument("--slices", type=int, default=3, help="disjoint text slices per row (interval)")
    parser.add_argument("--slice-stride", type=int, default=16384, help="tokens between slice starts")
    parser.add_argument("--grid-chunk", type=int, default=16, help="chunk_size of rows not pinned to 1")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per row and round")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--only", default="", help="comma-separated substrings: run only matching rows")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_quant"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m")
    starts = slice_starts(OmegaConf.create({"max_tokens": args.tokens, "slices": args.slices,
                                            "slice_stride": args.slice_stride}))  # fmt: skip
    pieces = slice_ids(tok, load_text("pg_essays"), starts, args.tokens, "pg_essays")
    selected = [r for r in rows(args.grid_chunk) if r.name == "full" or _matches(r.name, args.only)]
    done = []
    for row in selected:
        record, cache = perplexity_row(model, pieces, row)
        row.last_token = int(pieces[0][0, -1])
        print(json.dumps({k: v for k, v in record.items() if k != "params"}), flush=True)
        done.append((row, record, cache))
    speed_phase(model, done, args.decode_steps, args.repeats)
    records = [rec for _, rec, _ in done]
    add_ratios(records)
    meta = {
        "tokens": args.tokens,
        "slice_starts": starts,
        "threads": torch.get_num_threads(),
        "argv": vars(args) | {"out": str(args.out)},
    }
    write_json_atomic(
        args.out / "results.json", {"meta": meta, "environment": environment(model), "rows": records}
    )
    print(markdown_table(records, COLUMNS))
    return 0


def _matches(name: str, only: str) -> bool:
    return not only or any(part and part in name for part in only.split(","))


if __name__ == "__main__":
    raise SystemExit(main())
