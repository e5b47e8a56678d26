"""Records carry the code version that wrote them; ``resume`` reuses ok records of the same version only
(``true``), never (``false``) or of any version on purpose (``any``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import kvcompress.harness.cli  # noqa: F401  (the resolvers and declared/ groups the configs compose)
from kvcompress.core.registry import CONF_DIR as REGISTRY_DIR
from kvcompress.harness import app
from kvcompress.harness.results import code_version, load_record
from kvcompress.harness.sweep import completed_record, resume_mode

CONF_DIR = str(REGISTRY_DIR)
V1 = {"commit": "a" * 40, "dirty_hash": None}
V2 = {"commit": "a" * 40, "dirty_hash": "0123456789ab"}


def _run(checkpoint, out_dir, resume="true"):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["model=hf", f"model.name={checkpoint}", "task._target_=sweep_support.run",
                       "+task.point=1", f"resume={resume}"],
        )  # fmt: skip
    return app.run_experiment(cfg, out_dir)


def test_record_carries_the_code_version(tmp_path, tiny_checkpoint, calls, monkeypatch):
    monkeypatch.setattr(app, "code_version", lambda: V1)
    record = _run(tiny_checkpoint, tmp_path / "run")
    assert record["status"] == "ok" and record["code_version"] == V1
    assert load_record(tmp_path / "run")["code_version"] == V1


def test_record_holds_command_machine_and_threads(tmp_path, tiny_checkpoint, calls, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(app, "_hydra_overrides", lambda: ["policy=h2o", "task.note=a b"])
    record = _run(tiny_checkpoint, tmp_path / "run")
    assert record["command"] == "kvcompress policy=h2o 'task.note=a b'"
    env = record["environment"]
    assert env["omp_num_threads"] == "1" and env["threads"] >= 1
    assert env["machine"]["cpu_count"] >= 1 and "cpu" in env["machine"]


@pytest.mark.parametrize(
    ("resume", "second_version", "reruns", "says"),
    [
        ("true", V1, False, "skipped"),
        ("true", V2, True, "ok record not reused: it was written by code version"),
        ("false", V1, True, ""),
        ("any", V2, False, "resume=any reuses the ok record although"),
    ],
)
def test_resume_reuses_only_what_the_mode_allows(
    tmp_path, tiny_checkpoint, calls, monkeypatch, capsys, resume, second_version, reruns, says
):
    monkeypatch.setattr(app, "code_version", lambda: V1)
    first = _run(tiny_checkpoint, tmp_path / "run")
    monkeypatch.setattr(app, "code_version", lambda: second_version)  # the code changed (or not)
    capsys.readouterr()
    second = _run(tiny_checkpoint, tmp_path / "run", resume)
    assert calls() == ["full-1"] * (2 if reruns else 1)
    assert second["code_version"] == (second_version if reruns else V1)
    assert second["metrics"] == first["metrics"]
    assert says in capsys.readouterr().out


def test_records_of_unknown_version_are_rerun_unless_resume_any(tmp_path, tiny_checkpoint, calls, capsys):
    import json

    from kvcompress.harness.results import RESULTS_FILE

    config_of = _run(tiny_checkpoint, tmp_path / "run")["config"]
    old = {"status": "ok", "config": config_of, "metrics": {"perplexity": 1.0}}  # written by older code
    (tmp_path / "run" / RESULTS_FILE).write_text(json.dumps(old))
    assert completed_record(tmp_path / "run", config_of, "true", V1) is None
    assert "carries no code version" in capsys.readouterr().out
    assert completed_record(tmp_path / "run", config_of, "any", V1)["metrics"] == {"perplexity": 1.0}
    unknown = {"commit": None, "dirty_hash": None}  # running from an installed wheel: no git
    old["code_version"] = unknown
    (tmp_path / "run" / RESULTS_FILE).write_text(json.dumps(old))
    assert completed_record(tmp_path / "run", config_of, "true", unknown) is None
    assert "current code version is unknown" in capsys.readouterr().out


def test_a_record_without_a_field_at_its_default_is_the_same_config(tmp_path, capsys):
    """A policy field a record lacks stands at its declared default (records of kvzip written before its
    config listed ``apply_to``): the run is reused; the same field at another value is a new config."""
    import json

    from kvcompress.harness.results import RESULTS_FILE

    policy = {"_target_": "kvcompress.selectors.KVzipPolicy", "compression_ratio": 0.75}
    config = {"policy": {**policy, "apply_to": "full_attention"}, "task": {"max_tokens": 64}}
    old = {"status": "ok", "config": {**config, "policy": policy}, "metrics": {"x": 1}, "code_version": V1}
    (tmp_path / RESULTS_FILE).write_text(json.dumps(old))
    assert completed_record(tmp_path, config, "true", V1)["metrics"] == {"x": 1}
    other = {**config, "policy": {**policy, "apply_to": "all"}}
    assert completed_record(tmp_path, other, "true", V1) is None
    assert "config changed since the recorded run" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["maybe", 1, None, "ANY "])
def test_bad_resume_values_name_the_allowed_ones(value):
    with pytest.raises(ValueError, match=r"resume=.*allowed values: true: .*; false: .*; any: "):
        resume_mode(value)


def test_resume_mode_reads_yaml_booleans_and_any():
    assert [resume_mode(v) for v in (True, False, "true", "False", "any")] == [
        "true", "false", "true", "false", "any",
    ]  # fmt: skip


def test_bad_resume_value_fails_before_any_work(tmp_path, tiny_checkpoint, calls):
    with pytest.raises(ValueError, match="resume='maybe'"):
        _run(tiny_checkpoint, tmp_path / "run", "maybe")
    assert calls() == [] and not (tmp_path / "run").exists()


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)  # fmt: skip


def test_code_version_hashes_uncommitted_changes_of_the_package_only(tmp_path):
    repo = tmp_path / "repo"
    (repo / "kvcompress").mkdir(parents=True)
    (repo / "kvcompress" / "a.py").write_text("x = 1\n")
    (repo / "README.md").write_text("hello\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "init")
    clean = code_version(repo)
    assert len(clean["commit"]) == 40 and clean["dirty_hash"] is None
    (repo / "README.md").write_text("changed outside the package\n")
    assert code_version(repo) == clean
    (repo / "kvcompress" / "a.py").write_text("x = 2\n")
    first = code_version(repo)
    (repo / "kvcompress" / "a.py").write_text("x = 3\n")
    second = code_version(repo)
    assert first["commit"] == second["commit"] == clean["commit"]
    assert (
        None not in (first["dirty_hash"], second["dirty_hash"])
        and first["dirty_hash"] != second["dirty_hash"]
    )
    (repo / "kvcompress" / "a.py").write_text("x = 1\n")
    (repo / "kvcompress" / "new.py").write_text("y = 1\n")  # an untracked module changes the code too
    assert code_version(repo)["dirty_hash"] not in (None, first["dirty_hash"])


def test_code_version_has_no_commit_without_git_or_outside_a_repository(tmp_path, monkeypatch):
    inner = tmp_path / "repo" / "site-packages"
    inner.mkdir(parents=True)
    _git(tmp_path / "repo", "init", "-q")
    got = code_version(inner)  # another repository's commit is not ours; no package files there to hash
    assert (got["commit"], got["dirty_hash"], got["files_hash"]) == (None, None, None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # git is not installed: the files still say the code
    got = code_version()
    assert (got["commit"], got["dirty_hash"]) == (None, None) and len(got["files_hash"]) == 16


def test_this_checkout_has_a_version():
    version = code_version()
    assert version["commit"] is None or len(version["commit"]) == 40
