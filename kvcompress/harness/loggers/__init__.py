"""Where run records go besides ``results.json``: nowhere (``logger=none``), a JSONL file, or W&B.

A logger is chosen by ``conf/logger/<name>.yaml`` (``_target_`` plus its fields) and gets each run's
record (``log_run``) and, at the end of a multirun, the sweep's table and plots (``log_sweep``).
"""

from __future__ import annotations

import importlib


class Logger:
    """Base logger: does nothing."""

    def log_run(self, record: dict, out_dir) -> None:
        """One finished (or failed) run: its ``results.json`` record and output folder."""

    def log_sweep(self, summary: dict, sweep_dir) -> None:
        """A finished multirun: ``summary`` from ``kvcompress.harness.summary.summarize`` (rows, files)."""


NullLogger = Logger


def make_logger(cfg) -> Logger:
    """Instantiate the logger of a ``conf/logger`` config; no config or no ``_target_`` means none."""
    if cfg is None:
        return Logger()
    fields = {k: v for k, v in dict(cfg).items() if k != "name"}
    target = fields.pop("_target_", None)
    if target is None:
        return Logger()
    module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)(**fields)


def scalar_metrics(record: dict) -> dict:
    """The record's numeric metrics (per-case lists and nested values left out)."""
    metrics = record.get("metrics") or {}
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def table_metrics(record: dict) -> dict[str, list[dict]]:
    """The record's per-case tables: metrics whose value is a non-empty list of dicts."""
    metrics = record.get("metrics") or {}
    return {k: v for k, v in metrics.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
