"""Predicted cache bytes of every registered policy (at its defaults), from the memory model alone.

No model is loaded: the shape defaults to the embedded SmolLM2-135M (30 layers, 9 query / 3 KV heads,
head_dim 64). ``task=bench`` measures the same quantity (``cache_bytes``) and reports the ratio to it
(``bytes_vs_predicted``).

Usage: python scripts/predict_memory.py [--tokens 512 2048] [--decode 64] [--dtype-bytes 4]
"""

from __future__ import annotations

import argparse

from kvcompress import known_policies, make_policy
from kvcompress.harness.report import markdown_table
from kvcompress.memory_model import predicted_bytes
from kvcompress.selectors import ModelSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="prefill tokens")
    ap.add_argument("--decode", type=int, default=64, help="decode steps after the prefill")
    ap.add_argument("--dtype-bytes", type=int, default=4, help="4: float32, 2: bfloat16/float16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    spec = ModelSpec(args.layers, args.heads, args.kv_heads, args.head_dim, max_positions=0)
    rows = []
    for n in args.tokens:
        full = predicted_bytes("full", spec, n, args.dtype_bytes, decode_tokens=args.decode)
        for name in known_policies():
            pred = predicted_bytes(make_policy(name), spec, n, args.dtype_bytes, decode_tokens=args.decode)
            rows.append(
                {
                    "policy": name,
                    "context": n,
                    "decode_tokens": args.decode,
                    "predicted_bytes": pred,
                    "predicted_vs_full": None if pred is None else pred / full,
                }
            )
    print(markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
