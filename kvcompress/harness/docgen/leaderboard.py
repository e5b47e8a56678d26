"""The ``leaderboard`` and ``frontier`` generated blocks (``kvcompress.harness.leaderboard`` and ``.frontier``
compute them; the first also draws its figure)."""

from __future__ import annotations

from pathlib import Path

from kvcompress.harness import frontier
from kvcompress.harness import leaderboard as lb
from kvcompress.harness.docgen.records import provenance
from kvcompress.harness.report import load_records


def block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    """``leaderboard PATTERN out=PATH [pending]``: the figure (written to PATH, relative to the Markdown
    file) and the table of the records; the digest line ties the two to the records."""
    pattern = args[0] if args else f"{lb.RUNS}/*"
    records = [r for r in load_records(root, pattern) if lb.point_name(r["run_dir"])]
    points = lb.points(records)
    if not points:
        return f"_No leaderboard records yet in `{pattern}`._" if "pending" in args else None
    table_rows = lb.rows(points)
    data = lb.digest(table_rows)
    if options.get("_write", True):
        lb.plot(table_rows, md_path.parent / options["out"], data)
    return (
        f"![RULER score against bytes held, both question modes]({options['out']})\n\n"
        + lb.markdown(table_rows)
        + f"\n\n_Figure and table data `{data}` (the PNG's Description holds it). Intervals: 95% percentile "
        f"bootstrap over samples within each task ({lb.BOOTSTRAP} draws); `vs full` pairs each point with "
        f"`full` on the samples both answered in the same mode. Regenerate: `make leaderboard`._\n\n"
        + provenance(records, pattern)
    )


def frontier_block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    """``frontier PATTERN [pending]``: a frontier search's finished trials, each paired with the leaderboard's
    ``full`` in its question mode, the 5% rule and the Pareto set (``kvcompress.harness.frontier``)."""
    records = load_records(root, args[0])
    found = frontier.trials(records)
    if not found:
        return f"_No finished trials yet in `{args[0]}`._" if "pending" in args else None
    table_rows = frontier.rows(found, [p for p in lb.load(root) if p.name == "full"])
    return (
        frontier.markdown(table_rows)
        + f"\n\n_Within 5%: the paired difference from `full` is inside the noise and no lower than "
        f"{frontier.WITHIN:.0%} of `full`'s score on the same samples. Intervals as in the leaderboard._\n\n"
        + provenance(records, args[0])
    )
