"""Collect the results.json records under a run or sweep folder into one Markdown table.

Usage: python scripts/collect.py multirun/<sweep> [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from kvcompress.report import collect, flatten, markdown_table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="run or sweep folder holding results.json files")
    parser.add_argument("--csv", type=Path, help="also write the rows as CSV")
    parser.add_argument("--columns", help="comma-separated columns (default: the standard ones)")
    args = parser.parse_args(argv)
    records = collect(args.root)
    if not records:
        print(f"no results.json under {args.root}", file=sys.stderr)
        return 1
    rows = [flatten(r) for r in records]
    print(markdown_table(rows, args.columns.split(",") if args.columns else None))
    if args.csv:
        keys = sorted({k for r in rows for k in r})
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
