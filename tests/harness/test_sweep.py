"""Sweeps: a killed sweep started again finishes with one record per grid point; failures are recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcompress.harness.report import collect

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _sweep_cmd(checkpoint, *extra, entry="kvcompress"):
    return [
        sys.executable, "-m", entry, "-m", "model=hf", f"model.name={checkpoint}",
        "task._target_=sweep_support.run", "+task.point=1,2", "policy=full,sliding_window",
        "sweep_name=resume_test", *extra,
    ]  # fmt: skip


def _env(tmp_path, block=""):
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "KVC_TEST_LOG": str(tmp_path / "calls.log"),
            "KVC_TEST_BLOCK": block, "HF_HUB_OFFLINE": "1"}  # fmt: skip


def _wait_for(path: Path, proc, timeout=300):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "sweep never reached the blocking run"
        time.sleep(0.2)


# The code version both sweeps of the resume test record. Each used to compute its own from git: an edit or
# a commit of kvcompress/ between the killed sweep and its restart (a developer working while the suite runs;
# the slower the machine, the wider that window) made the restart rerun the ok records, by design.
PINNED = {"commit": "c0de" * 10, "dirty_hash": None}


def test_killed_sweep_restarted_has_one_record_per_point(tmp_path, tiny_checkpoint):
    cmd = _sweep_cmd(tiny_checkpoint, entry="sweep_support")  # kvcompress's CLI, code version pinned
    env = _env(tmp_path, block="sliding_window-1") | {"KVC_TEST_CODE_VERSION": json.dumps(PINNED)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    _wait_for(tmp_path / "calls.log.blocked", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole sweep dies in the middle of its third run
    proc.wait()
    sweep = tmp_path / "multirun" / "resume_test"
    before = {Path(r["run_dir"]).name: r["status"] for r in collect(sweep)}
    assert list(before.values()).count("running") == 1 and len(before) < 4  # killed before the end
    assert not (sweep / "summary.md").exists()

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    records = collect(sweep)
    assert len(records) == 4 and all(r["status"] == "ok" and r["code_version"] == PINNED for r in records)
    points = sorted((r["policy_name"], r["config"]["task"]["point"]) for r in records)
    assert points == [("full", 1), ("full", 2), ("sliding_window", 1), ("sliding_window", 2)]
    calls = (tmp_path / "calls.log").read_text().split()
    assert sorted(calls) == ["full-1", "full-2", "sliding_window-1", "sliding_window-1", "sliding_window-2"]
    assert again.stdout.count("[kvcompress] skipped") == len(before) - 1
    table = (sweep / "summary.md").read_text().strip().splitlines()
    assert len(table) == 2 + 4 and (sweep / "pareto.png").stat().st_size > 1000


def test_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path, tiny_checkpoint):
    cmd = _sweep_cmd(tiny_checkpoint, "+task.fail=false,true", "policy=full", "sweep_name=fail_test")
    cmd.remove("policy=full,sliding_window")
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "did not finish ok" in proc.stderr
    records = {
        (r["config"]["task"]["point"], r["config"]["task"]["fail"]): r for r in collect(tmp_path / "multirun")
    }
    assert len(records) == 4
    for (_, fail), record in records.items():
        assert record["status"] == ("failed" if fail else "ok")
        if fail:
            assert (
                record["error"] == "ValueError: task.fail=True: asked to fail"
                and "Traceback" in record["traceback"]
            )
    assert (tmp_path / "multirun" / "fail_test" / "summary.md").read_text().count("| failed |") == 2


def test_submitit_local_launcher_runs_the_sweep(tmp_path, tiny_checkpoint):
    cmd = _sweep_cmd(tiny_checkpoint, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10")
    cmd[cmd.index("+task.point=1,2")] = "+task.point=1"
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "multirun" / "resume_test"
    records = collect(sweep)
    assert sorted(r["policy_name"] for r in records) == ["full", "sliding_window"]
    assert all(r["status"] == "ok" for r in records) and (sweep / ".submitit").is_dir()
    assert sorted((tmp_path / "calls.log").read_text().split()) == ["full-1", "sliding_window-1"]


def test_a_sweep_prints_its_table_once_at_the_end_and_a_single_run_its_own(tmp_path, tiny_checkpoint):
    """Each run of a multirun prints no table; the end-of-sweep callback prints one with every run (what
    ``make run`` shows: its recipe collects nothing again). A single run prints its own row."""
    env = _env(tmp_path)
    proc = subprocess.run(_sweep_cmd(tiny_checkpoint), cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "multirun" / "resume_test" / "summary.md").read_text().strip()
    assert len(table.splitlines()) == 2 + 4 and table in proc.stdout
    assert _tables(proc.stdout) == 1, proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("[kvcompress] wrote ")  # the table came last
    recipe = (ROOT / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    assert "kvcompress -m" in recipe and "collect.py" not in recipe

    single = [a for a in _sweep_cmd(tiny_checkpoint, "hydra.run.dir=one") if "," not in a]
    single[single.index("-m", 2)] = "+task.point=1"  # Hydra's multirun flag (the first -m is Python's)
    one = subprocess.run([*single, "policy=full"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    assert _tables(one.stdout) == 1 and "| full |" in one.stdout, one.stdout


def _tables(out: str) -> int:
    """Markdown tables printed in ``out`` (one header rule each)."""
    return sum(line.startswith("|---") for line in out.splitlines())
