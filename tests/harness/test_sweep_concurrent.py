"""Two sweeps sharing a folder: a run another live process is still writing does not fail this sweep's end,
while a failed run, a killed one (its process gone) or one that cannot be checked still does."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
from omegaconf import OmegaConf

from kvcompress.harness import app
from kvcompress.harness.sweep import running_elsewhere, unfinished

HOST = socket.gethostname()


@pytest.fixture
def live_pid():
    """A process of this host that stays alive for the test."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _record(name, status="running", **process):
    return {"run_dir": name, "status": status, **({"process": process} if process else {})}


def test_a_run_of_a_live_process_elsewhere_is_not_a_failure(live_pid):
    records = [
        _record("ok", status="ok"),
        _record("failed", status="failed", host=HOST, pid=live_pid),
        _record("elsewhere", host=HOST, pid=live_pid),
        _record("killed", host=HOST, pid=_dead_pid()),
        _record("other_host", host=HOST + "-not-this-one", pid=live_pid),
        _record("older_record"),  # written before records named their process
        _record("this_process", host=HOST, pid=os.getpid()),  # this sweep's own run, left running: killed
    ]
    failed, elsewhere = unfinished(records)
    assert elsewhere == ["elsewhere"]
    assert failed == ["failed", "killed", "other_host", "older_record", "this_process"]
    assert running_elsewhere(records[2]) and not running_elsewhere(records[3])


def test_the_running_record_names_its_process_and_the_finished_one_does_not(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(app, "write_json_atomic", lambda path, record: written.append(dict(record)))
    monkeypatch.setattr(app, "_execute", lambda cfg, record, out_dir: {"score": 1.0})
    monkeypatch.setattr(app, "make_logger", lambda cfg: type("L", (), {"log_run": lambda *a: None})())
    record = app.run_experiment(OmegaConf.create({"resume": "false"}), tmp_path / "run")
    assert [w["status"] for w in written] == ["running", "ok"]
    assert written[0]["process"] == {"host": HOST, "pid": os.getpid()}
    assert "process" not in written[1] and "process" not in record
