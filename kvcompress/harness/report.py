"""Tables from result records (never from logs): one row per run, Markdown and CSV, plus the plots."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path

from kvcompress.harness.params import params_text
from kvcompress.harness.results import RESULTS_FILE, current_record
from kvcompress.metrics.stats import compare, compare_paired

DEFAULT_COLUMNS = [
    "policy",
    "selector",
    "storage",
    "params",
    "status",
    "tokens_scored",
    "perplexity",
    "recall_mean",
    "recall_min",
    "kl_mean",
    "top1_agreement",
    "chunk_size",
    "cache_bytes",
    "cache_ratio",
    "compressed",
    "storage_acted",
    "prefill_tok_s",
    "decode_tok_s",
    "question_in_prompt",
    "accuracy",
]


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return "" if value is None else str(value)


def flatten(record: dict) -> dict:
    """One table row from a results record: run folder, policy name and parameters (the storage's too),
    status, scalar metrics."""
    config = record.get("config", {})
    name = record.get("policy_name") or dict(config.get("policy", {})).get("_target_", "?").rsplit(".", 1)[-1]
    params = params_text(config)
    metrics = {k: v for k, v in record.get("metrics", {}).items() if not isinstance(v, (list, dict))}
    row = {"policy": name, "params": params, "status": record.get("status"), **metrics}
    row.update({k: record[k] for k in ("selector", "storage") if k in record})
    if "run_dir" in record:
        row["run"] = Path(record["run_dir"]).name
    return row


def columns_for(rows: list[dict]) -> list[str]:
    """Default columns present in ``rows``, then lm-eval metrics (``task/metric``)."""
    present = {k for r in rows for k in r}
    extra = sorted(k for k in present if "/" in k)
    return [c for c in DEFAULT_COLUMNS if c in present] + extra


def interval(row: dict, column: str) -> tuple[float, float] | None:
    """The 95% interval (``<column>_ci_low/_high``), interquartile range (``<column>_q1/_q3``) or range over
    rounds (``<column>_min/_max``) a row carries for ``column``, or None."""
    for low, high in (("_ci_low", "_ci_high"), ("_q1", "_q3"), ("_min", "_max")):
        a, b = row.get(column + low), row.get(column + high)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a, b
    return None


def cell(row: dict, column: str) -> str:
    """A table cell: the value, then ``± half`` for a symmetric interval, ``[low, high]`` for an asymmetric
    one (Wilson), ``(IQR low-high)`` for a speed's interquartile range and ``(range low-high)`` for the
    range of a median over rounds."""
    value, span = row.get(column), interval(row, column)
    if span is None or not isinstance(value, (int, float)):
        return _fmt(value)
    low, high = span
    if column + "_q1" in row:
        return f"{_fmt(value)} (IQR {_fmt(low)}-{_fmt(high)})"
    if column + "_min" in row and column + "_ci_low" not in row:
        return f"{_fmt(value)} (range {_fmt(low)}-{_fmt(high)})"
    if math.isclose(high - value, value - low, rel_tol=1e-6, abs_tol=1e-12):
        return f"{_fmt(value)} ± {_fmt(high - value)}"
    return f"{_fmt(value)} [{_fmt(low)}, {_fmt(high)}]"


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows as a Markdown table; a column with an interval in the row shows it in the same cell."""
    columns = columns or columns_for(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def compare_rows(name_a: str, a: dict, name_b: str, b: dict, metric: str = "perplexity") -> str:
    """One sentence on two table rows' ``metric`` (lower is better for perplexity and nll, higher for
    accuracies and speeds): "not distinguishable" when their intervals overlap or one is missing."""
    if a.get(metric) is None or b.get(metric) is None:
        raise ValueError(
            f"compare: both rows need a {metric!r} value (have {a.get(metric)}, {b.get(metric)})"
        )
    span_a, span_b = interval(a, metric) or (None, None), interval(b, metric) or (None, None)
    lower = metric.endswith(("perplexity", "nll")) or (metric.endswith("_s") and not metric.endswith("tok_s"))
    return compare(name_a, (a[metric], *span_a), name_b, (b[metric], *span_b), metric, lower)


def compare_records(name_a: str, a: dict, name_b: str, b: dict, metric: str = "perplexity") -> str:
    """Two records' ``metric``: paired over their text slices when both scored the same slices (perplexity
    or nll), paired over their cases when both answered the same retrieval cases (accuracy), else by their
    intervals (``compare_rows``)."""
    slices = [r.get("metrics", {}).get("slices") or [] for r in (a, b)]
    same = [[(s["offset_tokens"], s["tokens_scored"]) for s in sl] for sl in slices]
    if metric in ("perplexity", "nll") and len(same[0]) > 1 and same[0] == same[1]:
        values = [[s[metric] for s in sl] for sl in slices]
        return compare_paired(name_a, values[0], name_b, values[1], metric)
    cases = [_cases(r) for r in (a, b)]
    if metric == "accuracy" and cases[0] and [c[0] for c in cases[0]] == [c[0] for c in cases[1]]:
        correct = [[float(c[1]) for c in found] for found in cases]
        return compare_paired(name_a, correct[0], name_b, correct[1], metric, False, "cases")
    return compare_rows(name_a, flatten(a), name_b, flatten(b), metric)


def _cases(record: dict) -> list[tuple]:
    """A retrieval record's cases as ``((length, depth, needle, question_in_prompt), correct)``, from the
    ``*_cases.jsonl`` its run wrote (empty without one)."""
    folder = Path(record.get("run_dir") or "")
    files = sorted(folder.glob("*_cases.jsonl")) if record.get("run_dir") else []
    if len(files) != 1:
        return []
    rows = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    keys = ("length", "depth", "needle", "question_in_prompt")
    return [(tuple(r.get(k) for k in keys), r["correct"]) for r in rows if "correct" in r]


def csv_text(rows: list[dict]) -> str:
    keys = sorted({k for r in rows for k in r})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _natural_key(path: Path) -> list:
    """Sort key where numbers compare as numbers: ``window=28`` before ``window=124``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def collect(root: Path) -> list[dict]:
    """Every results record under ``root`` (a run or sweep folder), in natural path order."""
    records = []
    for path in sorted(Path(root).rglob(RESULTS_FILE), key=_natural_key):
        try:
            record = current_record(json.loads(path.read_text()))
        except json.JSONDecodeError:
            continue
        record["run_dir"] = str(path.parent)
        records.append(record)
    return records


def load_records(root: Path, pattern: str) -> list[dict]:
    """The ``ok`` records of the run folders matching ``pattern`` (a glob relative to ``root``), in natural
    order, each with its ``run_dir``."""
    found = []
    for run_dir in sorted(Path(root).glob(pattern), key=_natural_key):
        path = run_dir / RESULTS_FILE
        if not path.is_file():
            continue
        record = current_record(json.loads(path.read_text()))
        if record.get("status") == "ok":
            found.append({**record, "run_dir": str(run_dir)})
    return found
