"""Tables and plots from committed result records (``experiments/<name>/runs/*/results.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from kvcompress.core import registry
from kvcompress.harness.report import _natural_key, flatten, load_records, markdown_table
from kvcompress.metrics.stats import interval_fields, wilson

RECORD_COLUMNS = "policy,storage,settings,perplexity,cache_ratio,accuracy"


def _defaults(group: str, name: str | None) -> dict:
    """The config of ``group/name`` today (every declared field); ``{}`` for a name no longer registered."""
    return registry.load(group, name) if name in registry.known(group) else {}


def settings(record: dict) -> str:
    """The policy and storage fields that differ from their defaults (``budget=512 bits=4``), of a record
    read by ``load_records`` (under today's names: ``results.current_record``)."""
    config = record.get("config", {})
    policy, storage = dict(config.get("policy") or {}), dict(config.get("storage") or {})
    out = []
    for fields, defaults in ((policy, _defaults("policy", record.get("policy_name"))),
                             (storage, _defaults("storage", record.get("storage")))):  # fmt: skip
        out += [f"{k}={v}" for k, v in fields.items() if k != "_target_" and not _same(v, defaults.get(k, v))]
    return " ".join(out)


def _same(value, default) -> bool:
    """Whether a recorded field equals its default; in a nested config a field the record lacks was added
    after it was written, so it stands at its default."""
    if isinstance(value, dict) and isinstance(default, dict):
        return all(_same(v, default.get(k, v)) for k, v in value.items())
    return value == default


def row(record: dict) -> dict:
    """A table row: ``flatten`` plus ``settings``, the run folder's name and the task's length fields."""
    task = record.get("config", {}).get("task", {})
    extra = {k: task.get(k) for k in ("max_tokens", "prefix_tokens", "chunk_size", "lengths")}
    extra["lengths"] = ",".join(map(str, extra["lengths"] or [])) or None
    out = {**extra, **flatten(record), "settings": settings(record), "run": Path(record["run_dir"]).name}
    if "accuracy_ci_low" not in out and out.get("cases_total") and out.get("correct") is not None:
        low, high = wilson(int(out["correct"]), int(out["cases_total"]))  # records older than the field
        out |= interval_fields("accuracy", low, high)
    return out


def provenance(records: list[dict], pattern: str) -> str:
    """One line under a table: where the records are and what produced them."""
    env = [r.get("environment") or {} for r in records]
    commits = sorted({(e.get("git_commit") or "unknown")[:7] for e in env})
    threads = sorted({str(e.get("threads")) for e in env})
    cpus = sorted({(e.get("machine") or {}).get("cpu") or e.get("device") or "?" for e in env})
    return (
        f"_{len(records)} records in `{pattern}` (each holds its config); code {', '.join(commits)}; "
        f"threads {', '.join(threads)}; {', '.join(cpus)}. Regenerate: `make results`._"
    )


def records_block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    """``records PATTERN [columns=a,b] [pending]``: a table of the matching ok records, or None (drop)."""
    pattern = args[0]
    records = load_records(root, pattern)
    if not records:
        if "pending" in args:
            return f"_No records yet in `{pattern}`: run the experiment's `run.sh`, then `make results`._"
        return None
    rows = [row(r) for r in records]
    columns = [c for c in options.get("columns", RECORD_COLUMNS).split(",") if any(c in r for r in rows)]
    return markdown_table(rows, columns) + "\n\n" + provenance(records, pattern)


def pareto_block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    """``pareto PATTERN out=PATH``: perplexity vs cache bytes of the records, written to PATH (relative to
    the Markdown file) with 95% bars; the block is the image link. Dropped when the records are gone."""
    from kvcompress.harness.plots import plot_pareto

    records = load_records(root, args[0])
    if not records:
        return records_block(args, options, root, md_path) if "pending" in args else None
    out = md_path.parent / options["out"]
    if options.get("_write", True):
        out.parent.mkdir(parents=True, exist_ok=True)
        labelled = [{**row(r), "policy": f"{r.get('policy_name')} / {r.get('storage')}"} for r in records]
        plot_pareto([{**r, "params": r["settings"]} for r in labelled], out)
    caption = options.get("alt", "perplexity vs cache bytes")
    return f"![{caption}]({options['out']})\n\n" + provenance(records, args[0])


def rows_block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    """``rows PATTERN [key=rows] [columns=a,b] [pending]``: the ``rows`` (or another list, ``key=scaling``
    for ``task=bench``'s fitted lines) of multi-row records (``bench_quant.py``, ``task=bench``) in the
    folders matching ``PATTERN``; dropped (or pending) when none exists."""
    pattern, found, key = args[0], [], options.get("key", "rows")
    for run_dir in sorted(root.glob(pattern), key=_natural_key):
        path = run_dir / "results.json"
        if path.is_file():
            data = json.loads(path.read_text())
            rows = data.get(key) or (data.get("metrics") or {}).get(key) or []
            found.append(
                (data, [{k: v for k, v in r.items() if not isinstance(v, (list, dict))} for r in rows])
            )
    records = [data for data, rows in found if rows]
    if not records:
        return records_block([pattern, *args[1:]], options, root, md_path) if "pending" in args else None
    rows = [r for _, rs in found for r in rs]
    columns = [c for c in options.get("columns", ",".join(rows[0])).split(",") if any(c in r for r in rows)]
    return markdown_table(rows, columns) + "\n\n" + provenance(records, pattern)
