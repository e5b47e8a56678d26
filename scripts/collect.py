"""Collect the results.json records under a run or sweep folder into one table and PNG plots.

Usage: python scripts/collect.py multirun/<sweep> [--out DIR] [--csv out.csv] [--no-plots]

Writes summary.md, summary.csv, pareto.png (perplexity vs cache bytes), niah_heatmap.png (depth x
length per policy) and decode_speed.png (decode tokens/s vs context) where the records hold the data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompress.report import csv_text, markdown_table, summarize


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="run or sweep folder holding results.json files")
    parser.add_argument("--out", type=Path, help="where to write the table and plots (default: root)")
    parser.add_argument("--csv", type=Path, help="also write the rows as CSV to this file")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--columns", help="comma-separated columns for the printed table")
    args = parser.parse_args(argv)
    summary = summarize(args.root, args.out, plots=not args.no_plots)
    if summary is None:
        print(f"no results.json under {args.root}", file=sys.stderr)
        return 1
    if args.columns:
        print(markdown_table(summary["rows"], args.columns.split(",")))
    else:
        print(summary["markdown"])
    if args.csv:
        args.csv.write_text(csv_text(summary["rows"]))
    print("wrote " + ", ".join(str(p) for p in summary["files"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
