"""Sweeps that resume and report: skip runs already done, collect a finished multirun into tables/plots.

``kvcompress -m ...`` writes each run to ``multirun/<sweep_name>/<overrides>/results.json``: the folder
depends only on the sweep name and the run's overrides, so the same command started again finds every
record. A record counts as done when its status is ``ok`` and its config equals the new run's config.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kvcompress.results import load_record

# Keys that do not change what a run measures: a resumed sweep may log elsewhere or be renamed.
IGNORED_KEYS = ("logger", "resume", "sweep_name")


def run_dirname(overrides: str, max_len: int = 120) -> str:
    """Folder name of a sweep run from Hydra's ``override_dirname``: ``/`` made safe, long names hashed."""
    name = overrides.replace("/", "_") or "default"
    if len(name) > max_len:
        name = name[: max_len - 9] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def _comparable(config: dict) -> dict:
    plain = json.loads(json.dumps(config, default=str))  # what results.json holds after a round trip
    return {k: v for k, v in plain.items() if k not in IGNORED_KEYS}


def completed_record(out_dir: Path, config: dict) -> dict | None:
    """The ``ok`` record in ``out_dir`` if it was produced by the same config, else None (run it)."""
    record = load_record(out_dir)
    if record is None or record.get("status") != "ok":
        return None
    if _comparable(record.get("config", {})) != _comparable(config):
        print(f"[kvcompress] {out_dir}: config changed since the recorded run; running it again")
        return None
    return record


class CollectCallback(Callback):
    """Hydra callback: at the end of a multirun, one table + plots from the sweep's records.

    Exits with status 1 after collecting if any run failed (Hydra turns callback exceptions into
    warnings, so the exit is explicit).
    """

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from kvcompress.loggers import make_logger
        from kvcompress.report import summarize

        sweep_dir = Path(config.hydra.sweep.dir)
        summary = summarize(sweep_dir)
        if summary is None:
            return
        print(summary["markdown"])
        print("[kvcompress] wrote " + ", ".join(str(p) for p in summary["files"]))
        make_logger(config.get("logger")).log_sweep(summary, sweep_dir)
        failed = [r["run_dir"] for r in summary["records"] if r.get("status") != "ok"]
        if failed:
            print(f"[kvcompress] {len(failed)} run(s) did not finish ok (see results.json):", file=sys.stderr)
            print("\n".join(failed), file=sys.stderr)
            raise SystemExit(1)
