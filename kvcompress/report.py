"""Tables from result records (never from logs)."""

from __future__ import annotations

import json
from pathlib import Path

from kvcompress.results import RESULTS_FILE

DEFAULT_COLUMNS = [
    "policy",
    "params",
    "perplexity",
    "chunk_size",
    "cache_bytes",
    "cache_ratio",
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
    """One table row from a results record: policy name, its parameters, status and metrics."""
    policy = dict(record.get("config", {}).get("policy", {}))
    name = record.get("policy_name") or policy.pop("_target_", "?").rsplit(".", 1)[-1]
    policy.pop("_target_", None)
    params = " ".join(f"{k}={v}" for k, v in policy.items())
    return {"policy": name, "params": params, "status": record.get("status"), **record.get("metrics", {})}


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    columns = columns or [c for c in DEFAULT_COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def collect(root: Path) -> list[dict]:
    """Every results record under ``root`` (a run or sweep folder), in path order."""
    records = []
    for path in sorted(Path(root).rglob(RESULTS_FILE)):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        record["run_dir"] = str(path.parent)
        records.append(record)
    return records
