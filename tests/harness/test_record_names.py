"""Committed records keep the names they were written with; reading one back (sweep resume, tables) gives
its policy and storage configs under today's names (``results.current_record``): ``fused_attention`` as
``backend`` with its values mapped, ``residual_length`` as ``recent``, the pre-move ``_target_`` package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompress.harness.docgen.records import settings
from kvcompress.harness.report import collect, load_records
from kvcompress.harness.results import current_record, load_record
from kvcompress.harness.sweep import completed_record

ROOT = Path(__file__).resolve().parents[2]
QUANT = "kvcompress.storage.QuantStorage"
VERSION = {"commit": "a" * 40, "dirty_hash": None}


@pytest.mark.parametrize(
    "old,new",
    [("auto", "auto"), ("kernel", "cpu"), ("compile", "torch"), ("eager", "torch"), ("on", "torch"),
     ("off", "dense")],
)  # fmt: skip
def test_fused_attention_reads_as_backend_in_policies_storages_and_nested_storages(old, new):
    record = {"config": {
        "policy": {"_target_": "kvcompress.policies.SlidingWindowPolicy", "window": 8,
                   "storage": {"_target_": QUANT, "fused_attention": old, "residual_length": 4}},
        "storage": {"_target_": QUANT, "fused_attention": old},
        "task": {"fused_attention": "not a policy field: left alone"},
    }}  # fmt: skip
    config = current_record(record)["config"]
    assert config["policy"] == {"_target_": "kvcompress.selectors.SlidingWindowPolicy", "window": 8,
                                "storage": {"_target_": QUANT, "backend": new, "recent": 4}}  # fmt: skip
    assert config["storage"] == {"_target_": QUANT, "backend": new}
    assert config["task"] == record["config"]["task"]
    assert record["config"]["storage"] == {"_target_": QUANT, "fused_attention": old}  # not modified


def _write(run_dir: Path, storage: dict) -> Path:
    config = {"policy": {"_target_": "kvcompress.selectors.FullPolicy"}, "storage": storage, "task": {"x": 1}}
    run_dir.mkdir(parents=True)
    path = run_dir / "results.json"
    path.write_text(json.dumps({"status": "ok", "config": config, "code_version": VERSION}))
    return path


def test_a_sweep_resumes_a_record_written_with_fused_attention(tmp_path, capsys):
    path = _write(tmp_path / "run", {"_target_": QUANT, "bits": 2, "fused_attention": "kernel"})
    written = path.read_bytes()
    now = {"policy": {"_target_": "kvcompress.selectors.FullPolicy"}, "task": {"x": 1}}
    same = {**now, "storage": {"_target_": QUANT, "bits": 2, "backend": "cpu"}}
    other = {**now, "storage": {"_target_": QUANT, "bits": 2, "backend": "torch"}}
    assert completed_record(tmp_path / "run", same, "true", VERSION)["config"]["storage"]["backend"] == "cpu"
    assert completed_record(tmp_path / "run", other, "true", VERSION) is None
    assert "config changed since the recorded run" in capsys.readouterr().out
    assert path.read_bytes() == written  # the committed record is never rewritten


def test_tables_read_records_under_the_new_names(tmp_path):
    _write(tmp_path / "runs" / "a", {"_target_": QUANT, "fused_attention": "off"})
    one = load_record(tmp_path / "runs" / "a")
    for found in (load_records(tmp_path, "runs/*"), collect(tmp_path), [one]):
        assert found[0]["config"]["storage"] == {"_target_": QUANT, "backend": "dense"}
    record = {**load_records(tmp_path, "runs/*")[0], "policy_name": "full", "storage": "quant"}
    assert settings(record) == "backend=dense"


def test_committed_low_rank_records_show_backend_in_their_settings():
    """experiments/latent: ``fused_attention: on`` / ``off`` runs, written before the rename."""
    records = load_records(ROOT / "experiments", "latent/runs/ppl_*_rope_*")
    assert len(records) == 4
    for record in records:
        name = Path(record["run_dir"]).name
        assert f"backend={'torch' if name.endswith('_on') else 'dense'}" in settings(record).split()
