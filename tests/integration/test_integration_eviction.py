"""Eviction policies and the needle task on the embedded default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from kvcompress import make_policy
from kvcompress.harness.tasks import niah

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _cfg(**over):
    cfg = OmegaConf.load("kvcompress/conf/task/niah.yaml")
    cfg.update(lengths=[1024], depths=[50], progress=False, extra_needles=[], **over)
    return cfg


def test_needle_found_uncompressed_and_by_snapkv_at_half_budget(real_model):
    model, tok = real_model
    full = niah.run(model, tok, make_policy("full"), _cfg(question_in_prompt=False))["cases"][0]
    assert full["correct"], full["response"]
    snap = niah.run(model, tok, make_policy("snapkv"), _cfg(question_in_prompt=True))["cases"][0]
    assert snap["correct"], snap["response"]
    assert snap["cache_bytes"] < 0.55 * full["cache_bytes"]
    assert snap["tokens_stored_mean"] < 0.55 * full["tokens_stored_mean"]


def test_cli_niah_writes_cases_table_and_heatmap(tmp_path):
    cmd = [
        sys.executable, "-m", "kvcompress", "task=niah", "policy=tova", "task.lengths=[256]",
        "task.depths=[0,100]", "task.max_new_tokens=6", "task.progress=false", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "results.json").read_text())
    cases = record["metrics"]["cases"]
    # the default grid has two needles: each depth twice
    assert record["status"] == "ok" and [(c["depth"], c["needle"]) for c in cases] == [
        (0.0, 0),
        (0.0, 1),
        (100.0, 0),
        (100.0, 1),
    ]
    assert len((tmp_path / "niah_cases.jsonl").read_text().splitlines()) == 4
    assert 0 <= record["metrics"]["accuracy_ci_low"] <= record["metrics"]["accuracy"]
    assert (tmp_path / "niah_table.md").exists() and (tmp_path / "niah_heatmap.png").stat().st_size > 0
