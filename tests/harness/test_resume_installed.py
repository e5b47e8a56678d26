"""An installed package (no git checkout) knows its code: records carry its version and the hash of its
files, and ``resume=true`` reuses finished points of the same files and reruns those of other files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hydra import compose, initialize_config_dir

import kvcompress
import kvcompress.harness.cli  # noqa: F401  (the resolvers and declared/ groups the configs compose)
from kvcompress.core.registry import CONF_DIR
from kvcompress.harness import app
from kvcompress.harness.results import code_version, files_hash, installed_version
from kvcompress.harness.sweep import completed_record

PACKAGE = Path(kvcompress.__file__).parent


def _install(root: Path) -> Path:
    """A copy of the kvcompress package under ``root`` (outside any git checkout): what a wheel installs."""
    shutil.copytree(PACKAGE, root / "kvcompress", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _run(checkpoint, out_dir):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = [
            "model=hf",
            f"model.name={checkpoint}",
            "task._target_=sweep_support.run",
            "+task.point=1",
        ]
        return app.run_experiment(compose("config", overrides=overrides), out_dir)


def test_a_copy_outside_git_has_a_version_and_a_files_hash(tmp_path):
    a, b = _install(tmp_path / "a"), _install(tmp_path / "b")
    va, vb = code_version(a), code_version(b)
    assert va["commit"] is None and va["dirty_hash"] is None  # no checkout
    assert va["version"] == installed_version() == "0.1.0" and len(va["files_hash"]) == 16
    assert va == vb  # the same files: the same code version, wherever they are
    (b / "kvcompress" / "__pycache__").mkdir(exist_ok=True)
    (b / "kvcompress" / "__pycache__" / "x.pyc").write_bytes(b"\0")  # not code
    assert code_version(b)["files_hash"] == va["files_hash"]
    conf = next((b / "kvcompress" / "conf" / "policy").glob("*.yaml"))
    conf.write_text(conf.read_text() + "\n# edited\n")  # a YAML default is behaviour too
    assert code_version(b)["files_hash"] not in (None, va["files_hash"])


def test_files_hash_covers_sources_only_and_their_names(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "a.py").write_text("x = 1\n")
    first = files_hash(pkg)
    (pkg / "notes.txt").write_text("not code\n")
    assert files_hash(pkg) == first
    (pkg / "sub" / "a.py").rename(pkg / "sub" / "b.py")  # same bytes, another module name
    assert files_hash(pkg) != first
    assert files_hash(tmp_path / "missing") is None


def test_resume_from_an_installed_package_skips_finished_points(tmp_path, tiny_checkpoint, calls, monkeypatch,
                                                                capsys):  # fmt: skip
    installed = _install(tmp_path / "site-packages")
    monkeypatch.setattr(app, "code_version", lambda: code_version(installed))
    first = _run(tiny_checkpoint, tmp_path / "run")
    assert first["code_version"]["commit"] is None and first["code_version"]["files_hash"]
    capsys.readouterr()
    second = _run(tiny_checkpoint, tmp_path / "run")
    assert calls() == ["full-1"] and second["metrics"] == first["metrics"]  # the finished point: skipped
    assert "skipped" in capsys.readouterr().out
    module = installed / "kvcompress" / "harness" / "summary.py"
    module.write_text(module.read_text() + "\n# another build of the package\n")
    third = _run(tiny_checkpoint, tmp_path / "run")
    assert calls() == ["full-1", "full-1"]  # other files: the point is redone
    assert third["code_version"]["files_hash"] != first["code_version"]["files_hash"]
    assert "ok record not reused: it was written by code version" in capsys.readouterr().out


def test_checkout_and_installed_records_compare_on_what_both_carry(tmp_path):
    config = {"task": {"max_tokens": 64}}
    checkout = {"commit": "a" * 40, "dirty_hash": None, "version": "0.1.0", "files_hash": "f" * 16}
    wheel = {**checkout, "commit": None}
    old = {"commit": "a" * 40, "dirty_hash": None}  # a record written before records hashed their files

    def reused(recorded, current):
        record = {"status": "ok", "config": config, "code_version": recorded}
        (tmp_path / "results.json").write_text(json.dumps(record))
        return completed_record(tmp_path, config, "true", current) is not None

    assert reused(checkout, wheel) and reused(wheel, checkout)  # the same files, from a wheel or a checkout
    assert not reused(wheel, {**wheel, "files_hash": "e" * 16})
    assert reused(old, checkout)  # same commit, clean: as before
    assert not reused(old, wheel)  # nothing to compare an installed package's files with
    assert not reused(checkout, {**checkout, "files_hash": "e" * 16})  # same commit, other files
    assert not reused(wheel, {"commit": None, "dirty_hash": None, "version": None, "files_hash": None})
