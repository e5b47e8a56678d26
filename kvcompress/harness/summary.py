"""A finished multirun collected: its records as ``summary.md`` / ``summary.csv`` tables and PNG plots."""

from __future__ import annotations

from pathlib import Path

from kvcompress.harness.plots import make_plots
from kvcompress.harness.report import collect, csv_text, flatten, markdown_table
from kvcompress.resources.files import write_text_atomic


def summarize(root: Path, out_dir: Path | None = None, plots: bool = True) -> dict | None:
    """Collect ``root``'s records into ``summary.csv``, ``summary.md`` and PNG plots in ``out_dir``.

    Returns:
        ``{"records", "rows", "markdown", "files"}``, or None when ``root`` holds no record.
    """
    records = collect(root)
    if not records:
        return None
    out_dir = Path(out_dir or root)
    rows = [flatten(r) for r in records]
    markdown = markdown_table(rows)
    write_text_atomic(out_dir / "summary.md", markdown + "\n")
    write_text_atomic(out_dir / "summary.csv", csv_text(rows))
    files = [out_dir / "summary.md", out_dir / "summary.csv"]
    if plots:
        files += make_plots(records, out_dir)
    return {"records": records, "rows": rows, "markdown": markdown, "files": files}
