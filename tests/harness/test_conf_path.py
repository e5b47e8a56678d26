"""Plugins work the same from Python and the command line: ``KVCOMPRESS_CONF_PATH`` (a relative folder taken
from the current directory) and ``./conf`` reach both ``build_cache`` and Hydra's search path with no flag,
and a ``_target_`` that cannot be imported is refused naming its YAML and its module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PLUGINS, make_tiny
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from kvcompress import build_cache, known_policies
from kvcompress.core import conf_path, registry
from kvcompress.harness.cli import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]


def _compose(*overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _plugin(folder: Path, name: str, target: str) -> Path:
    (folder / "policy").mkdir(parents=True, exist_ok=True)
    (folder / "policy" / f"{name}.yaml").write_text(f"_target_: {target}\nrecent: 2\n")
    return folder


def _module(folder: Path, module: str, monkeypatch) -> str:
    """A plugin module of its own (a class no other YAML names) importable from ``folder``; its class."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(
        "from dataclasses import dataclass\nfrom example_selector import VnormPolicy\n\n\n"
        "@dataclass\nclass MyVnorm(VnormPolicy):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    return f"{module}.MyVnorm"


def test_a_relative_conf_path_reaches_hydra_and_build_cache_without_a_flag(tmp_path, monkeypatch):
    target = _module(tmp_path / "myplug", "my_selectors_rel", monkeypatch)
    _plugin(tmp_path / "myplug" / "conf", "vnorm_rel", target)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(registry.ENV, "myplug/conf")
    assert conf_path.searchpath() == [f"file://{tmp_path / 'myplug' / 'conf'}"]  # resolved against the cwd
    policy = _compose("policy=vnorm_rel").policy
    assert policy._target_ == target and policy.recent == 2 and policy.unit == "token"
    assert "vnorm_rel" in known_policies()
    assert build_cache("vnorm_rel", make_tiny("llama")).layers[0].policy.recent == 2


def test_the_current_directorys_conf_is_searched_like_the_conf_path(tmp_path, monkeypatch):
    _plugin(tmp_path / "conf", "vnorm_local", _module(tmp_path / "src", "my_selectors_local", monkeypatch))
    monkeypatch.chdir(tmp_path)
    assert conf_path.extra_dirs()[-1] == tmp_path / "conf"
    assert _compose("policy=vnorm_local").policy.recent == 2
    assert build_cache("vnorm_local", make_tiny("llama")).layers[0].policy.recent == 2
    monkeypatch.chdir(tmp_path / "conf")  # no conf/ here: nothing of it is searched
    assert "vnorm_local" not in known_policies()


def test_the_checkouts_conf_holds_its_experiments():
    """``conf/`` beside ``kvcompress/`` holds the checkout's own experiment configs, found from the root."""
    names = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    assert "window_budget" in names and not (Path(CONF_DIR) / "experiment").exists()
    assert (ROOT / "experiments" / "window_budget" / "config.yaml").read_text() == (
        ROOT / "conf" / "experiment" / "window_budget.yaml"
    ).read_text()


def test_a_target_module_that_cannot_be_imported_is_refused_naming_the_yaml_and_module(tmp_path, monkeypatch):
    yaml = _plugin(tmp_path, "vnorm_gone", "my_selectors_nowhere.VnormPolicy") / "policy" / "vnorm_gone.yaml"
    monkeypatch.setenv(registry.ENV, str(tmp_path))
    assert "vnorm_gone" in known_policies()  # registered: it fails by name only when used
    with pytest.raises(ModuleNotFoundError) as err:
        build_cache("vnorm_gone", make_tiny("llama"))
    text = str(err.value)
    assert str(yaml) in text and "'my_selectors_nowhere.VnormPolicy'" in text
    assert "module 'my_selectors_nowhere'" in text and "must be importable" in text and "PYTHONPATH" in text


def test_the_cli_runs_a_plugin_named_by_a_relative_conf_path(tmp_path):
    """``kvcompress policy=vnorm`` with ``KVCOMPRESS_CONF_PATH`` and no ``hydra.searchpath`` flag: the
    composed config is the plugin's (``--cfg job`` prints it without loading a model)."""
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "conf").symlink_to(PLUGINS / "conf")
    env = {**os.environ, registry.ENV: "plug/conf", "PYTHONPATH": str(PLUGINS)}
    cmd = [sys.executable, "-m", "kvcompress", "policy=vnorm", "--cfg", "job"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "_target_: example_selector.VnormPolicy" in done.stdout and "recent: 1" in done.stdout


def test_the_cli_refuses_an_unimportable_plugin_naming_its_yaml(tmp_path):
    yaml = (
        _plugin(tmp_path / "plug", "vnorm_gone", "my_selectors_nowhere.VnormPolicy")
        / "policy"
        / "vnorm_gone.yaml"
    )
    env = {**os.environ, registry.ENV: "plug"}
    cmd = [sys.executable, "-m", "kvcompress", "policy=vnorm_gone", "hydra.run.dir=run"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        f"{yaml}: _target_ 'my_selectors_nowhere.VnormPolicy' names module 'my_selectors_nowhere'"
        in done.stderr
    )
