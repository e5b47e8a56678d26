"""One Markdown table of retrieval accuracy (niah / passkey) from the results.json records under folders.

Rows: policy, its parameters, question mode, correct / total, accuracy with its 95% Wilson interval, and
Y/n per case at each depth (all lengths and needles pooled).

Usage: python scripts/retrieval_table.py multirun/niah-2k-full multirun/niah-2k-evict ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompress.harness.report import collect, flatten
from kvcompress.metrics.stats import wilson

SKIP = {"_target_", "policy"}


def _params(record: dict) -> str:
    policy = dict(record.get("config", {}).get("policy", {}))
    return " ".join(f"{k}={v}" for k, v in policy.items() if k not in SKIP and v is not None)


def rows(records: list[dict]) -> list[dict]:
    out = []
    for record in records:
        metrics = record.get("metrics") or {}
        if "cases" not in metrics:
            continue
        by_depth = {}
        for case in metrics["cases"]:
            by_depth.setdefault(case["depth"], []).append(case["correct"])
        k, n = metrics["correct"], metrics["cases_total"]
        row = {
            "policy": flatten(record)["policy"],
            "params": _params(record),
            "question_in_prompt": metrics["question_in_prompt"],
            "correct": f"{k}/{n}",
            "accuracy (95% Wilson)": "{:.2f} [{:.2f}, {:.2f}]".format(k / n, *wilson(k, n)),
        }
        row.update({f"{d:g}%": "".join("Y" if c else "n" for c in v) for d, v in sorted(by_depth.items())})
        out.append(row)
    return sorted(out, key=lambda r: (not r["question_in_prompt"], r["policy"], r["params"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path, help="run or sweep folders holding results.json")
    args = parser.parse_args(argv)
    table = rows([r for root in args.roots for r in collect(root)])
    if not table:
        print("no retrieval records found", file=sys.stderr)
        return 1
    cols = list(dict.fromkeys(k for r in table for k in r))
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in table:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
