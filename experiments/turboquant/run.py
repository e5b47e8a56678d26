"""Rotated quantization (turboquant) against KIVI (quant) near equal bytes, on the embedded default.

Every row streams the same disjoint essay slices through its cache in decode mode (chunks of ``--chunk``
tokens; each token scored from what came before) and records its mean NLL per slice and its bytes. The
table gives perplexity (mean, 95% t-interval over slices), bytes against ``full``, and each row's paired NLL
difference from ``full`` and from the KIVI row of its bits (paired over the slices). Record:
``experiments/turboquant/runs/<name>/results.json`` (written atomically after every row; a finished row is
not run again): ``raw`` (each row's NLL per slice and bytes) and ``rows`` (the table, ``make results``).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/turboquant/run.py            # about 10 min, one thread
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvcompress import build_cache, load_model
from kvcompress.harness.report import markdown_table
from kvcompress.harness.results import environment
from kvcompress.metrics import decode_perplexity
from kvcompress.metrics.stats import compare_paired, t_interval
from kvcompress.resources.data import load_text
from kvcompress.resources.files import write_json_atomic

HERE = Path(__file__).resolve().parent
RECENT = 64
ROWS = {  # name -> (policy, fields); recent tokens exact in every compressed row
    "full": ("full", {}),
    "quant int4 g32": ("quant", {"bits": 4, "group_size": 32}),
    "turboquant int4": ("turboquant", {"bits": 4}),
    "quant int2 g32": ("quant", {"bits": 2, "group_size": 32}),
    "quant int2 g16": ("quant", {"bits": 2, "group_size": 16}),
    "quant int2 g16 keys-per-token": ("quant", {"bits": 2, "group_size": 16, "key_axis": "token"}),
    "turboquant int2": ("turboquant", {"bits": 2}),
    "turboquant int2 g32": ("turboquant", {"bits": 2, "group_size": 32}),
    "turboquant int2 g16": ("turboquant", {"bits": 2, "group_size": 16}),
    "turboquant int2 sketch": ("turboquant", {"bits": 2, "sketch": True}),
}
KIVI = {"4": "quant int4 g32", "2": "quant int2 g32"}
PAIRS = [  # what the rotation and the sketch do alone, and int2 at about equal bytes
    ("turboquant int2 g16", "quant int2 g16 keys-per-token"),
    ("turboquant int2 sketch", "turboquant int2"),
    ("turboquant int2 g16", "quant int2 g16"),
]


def run_row(model, pieces, policy: str, fields: dict, chunk: int) -> dict:
    extra = {} if policy == "full" else {"recent": RECENT}
    nll, size = [], None
    for ids in pieces:
        cache = build_cache(policy, model, **fields, **extra)
        nll.append(decode_perplexity(model, ids, cache, chunk_size=chunk, progress=False)["nll"])
        size = size or cache.memory_bytes()
    return {"policy": policy, "fields": {**fields, **extra}, "nll": nll, "cache_bytes": size}


def table_rows(raw: dict) -> list[dict]:
    """One flat row per cache: perplexity (mean over slices, 95% t-interval), bytes against ``full``, and
    the NLL difference from ``full`` and from the KIVI row of its bits, paired over the slices."""
    full, out = raw["full"], []
    for name, row in raw.items():
        ci = t_interval([math.exp(x) for x in row["nll"]])
        kivi = KIVI.get(str(row["fields"].get("bits")))
        versus = "" if kivi in (None, name) or kivi not in raw else f"{_diff(row, raw[kivi])} ({kivi})"
        out.append({
            "row": name,
            "perplexity": f"{ci['mean']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]",
            "bytes_vs_full": round(row["cache_bytes"] / full["cache_bytes"], 4),
            "nll_vs_full": _diff(row, full),
            "nll_vs_kivi_same_bits": versus,
        })  # fmt: skip
    return out


def _diff(a: dict, b: dict) -> str:
    if a is b:
        return ""
    ci = t_interval([x - y for x, y in zip(a["nll"], b["nll"], strict=True)])
    return f"{ci['mean']:+.4f} [{ci['low']:+.4f}, {ci['high']:+.4f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--slices", type=int, default=6)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--name", default="main")
    args = parser.parse_args()
    out = HERE / "runs" / args.name / "results.json"
    record = json.loads(out.read_text()) if out.exists() else {"args": vars(args), "raw": {}}
    if record["args"] != vars(args):
        sys.exit(f"{out} was made with {record['args']}; use another --name")
    record["environment"] = environment()
    model, tok = load_model()
    ids = tok(load_text(), return_tensors="pt").input_ids
    stride = ids.shape[1] // args.slices
    pieces = [ids[:, k * stride : k * stride + args.tokens] for k in range(args.slices)]
    torch.manual_seed(0)
    for name, (policy, fields) in ROWS.items():
        if name in record["raw"]:
            continue
        start = time.perf_counter()
        record["raw"][name] = run_row(model, pieces, policy, fields, args.chunk)
        record["raw"][name]["seconds"] = time.perf_counter() - start
        record["rows"] = table_rows(record["raw"])
        write_json_atomic(out, record)
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    record["rows"] = table_rows(record["raw"])
    write_json_atomic(out, record)
    print(markdown_table(record["rows"], list(record["rows"][0])))
    raw = record["raw"]
    for bits, kivi in KIVI.items():
        for name, row in raw.items():
            if name.startswith("turboquant") and str(row["fields"]["bits"]) == bits:
                print("-", compare_paired(name, row["nll"], kivi, raw[kivi]["nll"], "NLL"))
    for a, b in PAIRS:
        print("-", compare_paired(a, raw[a]["nll"], b, raw[b]["nll"], "NLL"))


if __name__ == "__main__":
    main()
