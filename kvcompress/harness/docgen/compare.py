"""``compare`` blocks: one sentence per pair of committed runs, regenerated from their records.

``<!-- generated: compare BASE RUN [RUN ...] [metric=perplexity] -->`` (paths relative to the repository
root) prints, for each RUN, whether it differs from BASE on ``metric``: paired over the text slices when
both scored the same ones (the spread between essays cancels), else by their 95% intervals, and "not
distinguishable" when the difference may be noise. Dropped when a record is gone.

A run may also be one row of a multi-row record (``scripts/bench_quant.py`` writes one record whose
``rows`` each carry their slices): ``"PATH::ROW NAME"`` (quoted: row names have spaces).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvcompress.harness.report import compare_records, load_records


def _run(root: Path, arg: str) -> tuple[str, dict] | None:
    """(name, record) for a run folder or a ``PATH::ROW`` row; None when missing or not ok."""
    path, _, row = arg.partition("::")
    if not row:
        found = load_records(root, path)
        return (Path(path).name, found[0]) if len(found) == 1 else None
    file = root / path / "results.json"  # a rows record has no top-level status: each row has its own
    record = json.loads(file.read_text()) if file.is_file() else {}
    rows = [r for r in record.get("rows", []) if r.get("row") == row and r.get("status") == "ok"]
    return (row, {"metrics": rows[0]}) if len(rows) == 1 else None


def compare_block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    """The block's bullets, or None (drop) when the base or any run has no ok record."""
    metric = options.get("metric", "perplexity")
    runs = [_run(root, arg) for arg in args]
    if not args or any(run is None for run in runs):
        return None
    (name, base), rest = runs[0], runs[1:]
    return "\n".join(f"- {compare_records(name, base, other, rec, metric)}" for other, rec in rest)
