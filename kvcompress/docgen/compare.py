"""``compare`` blocks: one sentence per pair of committed runs, regenerated from their records.

``<!-- generated: compare BASE RUN [RUN ...] [metric=perplexity] -->`` (paths relative to the repository
root) prints, for each RUN, whether it differs from BASE on ``metric``: paired over the text slices when
both scored the same ones (the spread between essays cancels), else by their 95% intervals, and "not
distinguishable" when the difference may be noise. Dropped when a record is gone.
"""

from __future__ import annotations

from pathlib import Path

from kvcompress.docgen.records import load_records
from kvcompress.report import compare_records


def compare_block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    """The block's bullets, or None (drop) when the base or any run has no ok record."""
    metric = options.get("metric", "perplexity")
    runs = [load_records(root, pattern) for pattern in args]
    if not args or any(len(found) != 1 for found in runs):
        return None
    base, name = runs[0][0], Path(args[0]).name
    pairs = zip(args[1:], runs[1:], strict=True)
    return "\n".join(f"- {compare_records(name, base, Path(p).name, r[0], metric)}" for p, r in pairs)
