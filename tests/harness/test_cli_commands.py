"""The command line's own commands: ``--help`` lists them, a bad input prints its message alone (the same
named error as the Python API), ``kvcompress compare RUN_A RUN_B`` chooses its metric from the records, and
``kvcompress check-policy NAME`` runs the policy contract without pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PLUGINS

from kvcompress.core import registry
from kvcompress.harness import check_policy, compare

TASKS = {"niah": "kvcompress.harness.tasks.niah.run", "perplexity": "kvcompress.harness.tasks.perplexity.run"}


def _cli(*args, cwd, env=None):
    cmd = [sys.executable, "-m", "kvcompress", *args]
    return subprocess.run(
        cmd, cwd=cwd, env=env or os.environ.copy(), capture_output=True, text=True, timeout=300
    )


def test_help_lists_the_subcommands_and_hides_the_internal_groups(tmp_path):
    done = _cli("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for usage in ("ask CONTEXT", "bench [overrides]", "compare RUN_A RUN_B", "check-policy NAME"):
        assert f"kvcompress {usage}" in done.stdout
    assert "policy: block_evict," in done.stdout and "declared/" not in done.stdout


def test_a_misspelled_field_gets_the_python_apis_named_error_without_a_traceback(tmp_path):
    """Hydra's own suggestion, ``+policy.compresion_ratio=0.5``, is refused as ``build_cache`` refuses it."""
    with pytest.raises(ValueError) as api:
        registry.from_name("policy", "snapkv", {"compresion_ratio": 0.5})
    done = _cli("policy=snapkv", "+policy.compresion_ratio=0.5", "hydra.run.dir=run", cwd=tmp_path)
    assert done.returncode == 1 and str(api.value) in done.stderr and "Traceback" not in done.stderr
    bad = _cli("policy=snapkv", "policy.compression_ratio=1.5", "hydra.run.dir=run", cwd=tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 2 and "compression_ratio=1.5 must be in" in bad.stderr
    assert str(tmp_path / "run") in bad.stderr  # where its failure record is
    full = _cli("policy=snapkv", "policy.compression_ratio=1.5", cwd=tmp_path,
                env={**os.environ, "HYDRA_FULL_ERROR": "1"})  # fmt: skip
    assert full.returncode == 1 and "Traceback" in full.stderr and "must be in" in full.stderr


def _run(folder: Path, task: str, metrics: dict) -> Path:
    folder.mkdir(parents=True)
    record = {"status": "ok", "config": {"task": {"_target_": TASKS[task]}}, "metrics": metrics}
    (folder / "results.json").write_text(json.dumps(record))
    return folder


def test_compare_chooses_the_metric_from_the_records(tmp_path, capsys):
    a = _run(tmp_path / "a", "niah", {"accuracy": 0.9, "accuracy_ci_low": 0.8, "accuracy_ci_high": 0.95,
                                      "perplexity": 3.0})  # fmt: skip
    b = _run(tmp_path / "b", "niah", {"accuracy": 0.3, "accuracy_ci_low": 0.2, "accuracy_ci_high": 0.4,
                                      "perplexity": 3.0})  # fmt: skip
    assert compare.main([str(a), str(b)]) == 0
    assert capsys.readouterr().out.startswith("a is better than b on accuracy")
    p = _run(
        tmp_path / "p",
        "perplexity",
        {"perplexity": 10.0, "perplexity_ci_low": 9.0, "perplexity_ci_high": 11.0},
    )
    q = _run(
        tmp_path / "q",
        "perplexity",
        {"perplexity": 10.5, "perplexity_ci_low": 9.5, "perplexity_ci_high": 11.5},
    )
    assert compare.main([str(p), str(q)]) == 0
    assert "not distinguishable" in capsys.readouterr().out  # overlapping intervals
    assert compare.main([str(a), str(p)]) == 1
    assert "different tasks (niah and perplexity)" in capsys.readouterr().err
    assert compare.main([str(a), str(b), "--metric", "recall"]) == 1
    assert "'recall' is not a number both runs hold" in capsys.readouterr().err
    assert compare.wants_runs(["runs/a", "runs/b"]) and not compare.wants_runs(["policy=h2o"])
    assert not compare.wants_runs(["--cfg", "job"]) and not compare.wants_runs([])


def test_the_collect_script_compares_through_the_package(tmp_path):
    a = _run(tmp_path / "a", "niah", {"accuracy": 1.0, "accuracy_ci_low": 0.9, "accuracy_ci_high": 1.0})
    b = _run(tmp_path / "b", "niah", {"accuracy": 0.2, "accuracy_ci_low": 0.1, "accuracy_ci_high": 0.3})
    script = Path(__file__).resolve().parents[2] / "scripts" / "collect.py"
    done = subprocess.run([sys.executable, script, "--compare", a, b], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("a is better than b on accuracy"), done.stderr


def test_check_policy_passes_a_plugin_and_fails_a_broken_one(tmp_path, monkeypatch, capsys):
    only = ["--check", "seq_length_is_absolute_position", "--check", "memory_bytes_counts_every_tensor"]
    assert check_policy.main(["vnorm", *only, "--family", "llama"]) == 0
    out = capsys.readouterr().out
    assert "PASS seq_length_is_absolute_position [llama]" in out and "2 of 2 passed" in out
    (tmp_path / "conf" / "policy").mkdir(parents=True)
    (tmp_path / "broken_plug.py").write_text(
        "from dataclasses import dataclass\nfrom example_selector import VnormPolicy\n"
        "from kvcompress.selectors.eviction.scorer import ScorerLayer\n\n\n"
        "class Stored(ScorerLayer):\n    def get_seq_length(self, *a, **k):\n"
        "        return self.stored_length()  # the stored tokens: wrong after an eviction\n\n\n"
        "@dataclass\nclass Broken(VnormPolicy):\n    layer_class = Stored\n"
    )
    (tmp_path / "conf" / "policy" / "broken_vnorm.yaml").write_text("_target_: broken_plug.Broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.ENV, os.pathsep.join([str(PLUGINS / "conf"), str(tmp_path / "conf")]))
    assert check_policy.main(["broken_vnorm", *only, "--family", "llama"]) == 1
    out = capsys.readouterr().out
    assert "FAIL seq_length_is_absolute_position [llama]: AssertionError: after 30 tokens" in out
    assert "1 of 2 passed; 1 FAILED" in out
    assert check_policy.main(["no_such_policy"]) == 1
    assert "policy='no_such_policy' is unknown" in capsys.readouterr().err


@pytest.mark.slow
def test_a_single_run_prints_its_output_folder(tmp_path, tiny_checkpoint):
    from helpers import fake_essay

    (tmp_path / "essay.txt").write_text(fake_essay(0))
    task = [
        "task.max_tokens=32",
        "task.slices=1",
        "task.speed=false",
        "task.progress=false",
        "task.text=essay.txt",
    ]
    done = _cli("model=hf", f"model.name={tiny_checkpoint}", *task, "hydra.run.dir=run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"[kvcompress] output folder: {tmp_path / 'run'}"
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "ok"
