"""Collect the results.json records under a run or sweep folder into one table and PNG plots; regenerate
every results table in the docs (``--docs``); compare two runs (``--compare``).

Usage:
    python scripts/collect.py multirun/<sweep> [--out DIR] [--csv out.csv] [--no-plots] [--columns a,b]
    python scripts/collect.py --docs [--check]        # = make results; --check: only report differences
    python scripts/collect.py --compare RUN_A RUN_B [--metric M]  # = kvcompress compare RUN_A RUN_B

Writes summary.md, summary.csv, pareto.png (perplexity vs cache bytes, 95% bars), niah_heatmap.png (depth x
length per policy) and decode_speed.png (decode tokens/s vs context, interquartile bars) where the records
hold the data. Cells show 95% intervals (perplexity: t over text slices; accuracy: Wilson) and speed IQRs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompress.harness.compare import main as compare_main
from kvcompress.harness.report import csv_text, markdown_table
from kvcompress.harness.summary import summarize


def docs(check: bool) -> int:
    """Regenerate (or check) every generated block of the README, docs/ and experiment READMEs."""
    from kvcompress.harness.docgen import regenerate

    report = regenerate(check=check)
    for spec in report.dropped:
        print(f"dropped (its records are gone): {spec}", file=sys.stderr)
    verb = "differ from their records" if check else "rewritten"
    print(f"{report.blocks} generated blocks; {len(report.changed)} files {verb}: {report.changed}")
    return 1 if check and report.changed else 0


def compare(a: Path, b: Path, metric: str | None) -> int:
    """``kvcompress compare`` (``kvcompress.harness.compare``): one sentence on two runs' metric, chosen
    from the records unless ``metric`` names one."""
    return compare_main([str(a), str(b), *(["--metric", metric] if metric else [])])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, nargs="?", help="run or sweep folder holding results.json files")
    parser.add_argument("--out", type=Path, help="where to write the table and plots (default: root)")
    parser.add_argument("--csv", type=Path, help="also write the rows as CSV to this file")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--columns", help="comma-separated columns for the printed table")
    parser.add_argument("--docs", action="store_true", help="regenerate every results table in the docs")
    parser.add_argument("--check", action="store_true", help="with --docs: report differences, write nothing")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("RUN_A", "RUN_B"), help="compare two runs")
    parser.add_argument("--metric", help="with --compare (default: chosen from the records)")
    args = parser.parse_args(argv)
    if args.docs:
        return docs(args.check)
    if args.compare:
        return compare(*args.compare, args.metric)
    if args.root is None:
        parser.error("give a run or sweep folder, --docs or --compare")
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
