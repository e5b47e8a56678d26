"""``kvcompress compare RUN_A RUN_B [--metric M]``: one sentence on two finished runs' main metric.

The metric comes from the records: perplexity for perplexity and fidelity runs, accuracy for retrieval
(NIAH, passkey, multi-needle); ``--metric`` names any other number the records hold. Runs that scored the
same text slices (or retrieval cases) are compared paired, others by their intervals; a difference that may
be noise is reported as "not distinguishable".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompress.harness.report import compare_records
from kvcompress.harness.results import load_record

# the metric a task's records are compared on (the module of the task's _target_, e.g. tasks.niah.run)
TASK_METRICS = {
    "perplexity": "perplexity",
    "fidelity": "perplexity",
    "niah": "accuracy",
    "passkey": "accuracy",
    "multi_niah": "accuracy",
}
FALLBACK = ("perplexity", "accuracy", "score")  # in this order, the first both records hold


def _task(record: dict) -> str | None:
    target = ((record.get("config") or {}).get("task") or {}).get("_target_") or ""
    parts = target.split(".")
    return parts[-2] if len(parts) >= 2 else None


def _numbers(record: dict) -> set[str]:
    metrics = record.get("metrics") or {}
    return {k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def choose_metric(a: dict, b: dict) -> str:
    """The metric two records are compared on: their task's (``TASK_METRICS``), else the first of
    ``FALLBACK`` both hold. Raises, naming the tasks, when the records are of different tasks or hold none."""
    tasks = [_task(r) for r in (a, b)]
    if tasks[0] != tasks[1]:
        raise ValueError(f"compare: the runs are of different tasks ({tasks[0]} and {tasks[1]})")
    both = _numbers(a) & _numbers(b)
    metric = TASK_METRICS.get(tasks[0])
    if metric in both:
        return metric
    for name in FALLBACK:
        if name in both:
            return name
    raise ValueError(
        f"compare: no metric to choose for task {tasks[0]!r} (neither record holds one of {list(FALLBACK)}); "
        f"name one with --metric, among {sorted(both)}"
    )


def compare_runs(a: Path, b: Path, metric: str | None = None) -> str:
    """The sentence on runs ``a`` and ``b`` (folders holding an ``ok`` results.json); ``metric`` None: from
    the records (``choose_metric``)."""
    records = []
    for path in (a, b):
        record = load_record(Path(path))
        if record is None or record.get("status") != "ok":
            status = "none" if record is None else record.get("status")
            raise ValueError(f"compare: {path} holds no ok results.json (status: {status})")
        records.append({**record, "run_dir": str(path)})
    metric = metric or choose_metric(*records)
    if metric not in _numbers(records[0]) & _numbers(records[1]):
        held = sorted(_numbers(records[0]) & _numbers(records[1]))
        raise ValueError(f"compare: --metric {metric!r} is not a number both runs hold; they hold {held}")
    return compare_records(Path(a).name, records[0], Path(b).name, records[1], metric)


def wants_runs(args: list[str]) -> bool:
    """Whether ``kvcompress compare ARGS`` compares finished runs (its first argument a folder, not a
    ``key=value`` override or a flag); otherwise it is the ``task=compare`` run."""
    return bool(args) and not args[0].startswith(("-", "+", "~")) and "=" not in args[0]


def main(argv: list[str] | None = None) -> int:
    """The ``kvcompress compare RUN_A RUN_B`` command; 0 on success, 1 with a message on a bad input."""
    parser = argparse.ArgumentParser(prog="kvcompress compare", description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs=2, metavar="RUN", help="run folders holding results.json")
    parser.add_argument("--metric", help="the number to compare (default: chosen from the records)")
    args = parser.parse_args(argv)
    try:
        print(compare_runs(*args.runs, args.metric))
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
