"""`hydra/launcher=ray`: a four-point sweep on a local Ray cluster started by the test, killed halfway and
started again, ends with one ok record per point and reruns only what had not finished."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_sweep import _env, _sweep_cmd, _wait_for

from kvcompress.harness.report import collect

pytest.importorskip("ray")
pytest.importorskip("hydra_plugins.hydra_ray_launcher")
pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}  # a throwaway local cluster


BLOCK = "sliding_window-1"


@pytest.fixture
def ray_cluster(tmp_path):
    """A one-node Ray cluster (2 CPUs) in its own session and temp folder, stopped with every process it
    started when the test ends (or fails). Its workers get the test's environment (as a cluster's nodes
    have kvcompress installed) and start in another folder than the sweep's."""
    port, temp = _free_port(), Path("/tmp") / f"kvc_ray_{os.getpid()}"  # Ray's socket paths must stay short
    cmd = [RAY, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
           "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={temp}"]  # fmt: skip
    env = _env(tmp_path, block=BLOCK) | RAY_ENV
    head = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env, cwd=tempfile.gettempdir())  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        status = [RAY, "status", f"--address={address}"]
        while subprocess.run(status, capture_output=True, env=env).returncode != 0:
            assert head.poll() is None and time.time() < deadline, "the Ray head did not start"
            time.sleep(1)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # a throwaway cluster: its whole process group, at once
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def _calls(tmp_path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().split() if log.exists() else []


def test_ray_sweep_killed_halfway_resumes_without_redoing_finished_points(
    tmp_path, tiny_checkpoint, ray_cluster
):
    # resume=any: the jobs compute their code version in Ray's workers, where the test cannot pin it, so an
    # edit of kvcompress/ while the test runs would otherwise (rightly) rerun every point
    extra = ("hydra/launcher=ray", f"hydra.launcher.ray.init.address={ray_cluster}", "resume=any")
    cmd = _sweep_cmd(tiny_checkpoint, *extra)
    env = _env(tmp_path, block=BLOCK) | RAY_ENV
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    _wait_for(tmp_path / "calls.log.blocked", proc)
    sweep = tmp_path / "multirun" / "resume_test"
    deadline = time.time() + 120  # the other core finishes points while one blocks: kill after one is done
    while not any(r["status"] == "ok" for r in collect(sweep)):
        assert proc.poll() is None and time.time() < deadline, "no point finished beside the blocked one"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver dies; Ray cancels the tasks it owned
    proc.wait()
    before = {Path(r["run_dir"]).name: r["status"] for r in collect(sweep)}
    done = [name for name, status in before.items() if status == "ok"]
    assert 1 <= len(done) < 4 and not (sweep / "summary.md").exists()
    calls_before = _calls(tmp_path)

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    records = collect(sweep)
    assert len(records) == 4 and all(r["status"] == "ok" for r in records)
    points = sorted((r["policy_name"], r["config"]["task"]["point"]) for r in records)
    assert points == [("full", 1), ("full", 2), ("sliding_window", 1), ("sliding_window", 2)]
    rerun = sorted(_calls(tmp_path)[len(calls_before) :])
    finished = sorted(f"{r['policy_name']}-{r['config']['task']['point']}" for r in records
                      if Path(r["run_dir"]).name in done)  # fmt: skip
    everything = ["full-1", "full-2", "sliding_window-1", "sliding_window-2"]
    assert rerun == sorted(set(everything) - set(finished))  # the finished points were not run again
    assert (again.stdout + again.stderr).count("[kvcompress] skipped") == len(done)
    assert len((sweep / "summary.md").read_text().strip().splitlines()) == 2 + 4
