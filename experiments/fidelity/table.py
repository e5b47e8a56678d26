"""The fidelity table of experiments/fidelity/README.md, from the run records (never retyped).

Usage: python experiments/fidelity/table.py   (prints a Markdown table)
"""

from __future__ import annotations

import json
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"
SETTINGS = {
    "sliding_window": "sink 4 + window 508",
    "h2o": "ratio 0.5",
    "tova": "ratio 0.5",
    "snapkv_prefix512": "ratio 0.5, prefix_tokens=512",
    "block_evict": "ratio 0.5 (blocks of 32)",
    "block_sparse": "read_ratio 0.5 (pages of 16)",
    "quant_int4": "int4 (group 32, residual 128)",
    "quant_int2": "int2 (group 32, residual 128)",
}
HEAD = (
    "| policy | setting | tokens scored | mean recall | min recall (worst step) | worst layer's recall "
    "| mean KL | top-1 agreement | perplexity | full ppl, same tokens | cache_ratio | output error "
    "| key error |"
)


def row(name: str, m: dict) -> str:
    cells = [
        json.loads((RUNS / name / "results.json").read_text())["policy_name"],
        SETTINGS[name],
        m["tokens_scored"],
        f"{m['recall_mean']:.4f}",
        f"{m['recall_min']:.4f}",
        f"{m['recall_min_layer']:.3f} (layer {m['recall_min_layer_idx']})",
        f"{m['kl_mean']:.4f}",
        f"{m['top1_agreement']:.4f}",
        f"{m['perplexity']:.2f}",
        f"{m['full_perplexity']:.2f}",
        f"{m['cache_ratio']:.3f}",
        f"{m['output_error_mean']:.3f}",
        f"{m['key_error_mean']:.3f}",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    print(HEAD)
    print("|" + "---|" * HEAD.count(" | ") + "---|")
    for name in SETTINGS:
        record = json.loads((RUNS / name / "results.json").read_text())
        print(row(name, record["metrics"]))


if __name__ == "__main__":
    main()
