"""Loggers: JSONL appends whole lines; W&B (offline, no account) gets config, metrics, tables, plots."""

from __future__ import annotations

import json

import pytest

from kvcompress.harness.loggers import make_logger
from kvcompress.harness.loggers.jsonl import JsonlLogger

RECORD = {
    "status": "ok",
    "policy_name": "sliding_window",
    "config": {
        "policy": {"_target_": "kvcompress.selectors.SlidingWindowPolicy", "window": 8},
        "sweep_name": "t",
    },
    "metrics": {
        "perplexity": 12.5,
        "cache_bytes": 2048,
        "cases": [
            {"depth": 0.0, "length": 256, "exact_match": 1.0},
            {"depth": 1.0, "length": 256, "exact_match": 0.0},
        ],
    },
    "traceback": "not logged",
}


def test_jsonl_logger_appends_runs_and_sweeps(tmp_path):
    logger = JsonlLogger(path=str(tmp_path / "logs" / "runs.jsonl"))
    logger.log_run(RECORD, tmp_path / "run0")
    logger.log_run({**RECORD, "status": "failed"}, tmp_path / "run1")
    logger.log_sweep({"rows": [{"policy": "full"}], "files": [tmp_path / "pareto.png"]}, tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "logs" / "runs.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["run", "run", "sweep"]
    assert lines[0]["metrics"]["perplexity"] == 12.5 and lines[0]["out_dir"] == str(tmp_path / "run0")
    assert lines[1]["status"] == "failed" and "traceback" not in lines[0]
    assert lines[2]["rows"] == [{"policy": "full"}] and lines[2]["files"] == [str(tmp_path / "pareto.png")]


def test_make_logger_without_target_is_a_no_op():
    assert type(make_logger({"name": "none"})).__name__ == "Logger"
    assert type(make_logger(None)).__name__ == "Logger"


wandb = pytest.importorskip("wandb")


def test_wandb_disabled_mode_run_summary_holds_metrics_and_config(tmp_path):
    logger = make_logger({"_target_": "kvcompress.harness.loggers.wandb_run.WandbLogger", "mode": "disabled"})
    logger.log_run(RECORD, tmp_path / "run0")
    run = logger.last_run
    assert run.summary["perplexity"] == 12.5 and run.summary["cache_bytes"] == 2048
    assert run.summary["status"] == "ok" and run.summary["policy"] == "sliding_window"
    assert run.config["policy"]["window"] == 8
    table = run.summary["cases"]
    assert table.columns == ["depth", "exact_match", "length"] and table.data[1] == [1.0, 0.0, 256]


def test_wandb_offline_run_writes_tables_and_plots_next_to_results(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = make_logger({"_target_": "kvcompress.harness.loggers.wandb_run.WandbLogger", "mode": "offline"})
    logger.log_run(RECORD, tmp_path / "run0")
    (run_dir,) = (tmp_path / "run0" / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("run-*.wandb"))  # what `wandb sync` uploads later
    (table_file,) = (run_dir / "files" / "media" / "table").glob("cases_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["depth", "exact_match", "length"] and table["data"][0] == [0.0, 1.0, 256]

    from PIL import Image

    png = tmp_path / "pareto.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(png)
    logger.log_sweep({"rows": [{"policy": "full", "perplexity": 3.0}], "files": [png]}, tmp_path / "sweep")
    (sweep_run,) = (tmp_path / "sweep" / "wandb").glob("offline-run-*")
    assert list((sweep_run / "files" / "media" / "images").glob("pareto_*.png"))
    (summary_file,) = (sweep_run / "files" / "media" / "table").glob("summary_*.table.json")
    assert json.loads(summary_file.read_text())["data"] == [[3.0, "full"]]
