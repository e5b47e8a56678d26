"""Heavy launchers, sweepers and loggers are extras: a plain install leaves them out, and a command that
selects one without its extra is refused before Hydra starts, naming the extra to install."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcompress.core.conf_path import conf_dirs
from kvcompress.harness import cli, extras
from kvcompress.harness.loggers.wandb_run import WandbLogger

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("ray", "hydra-ray-launcher", "hydra-submitit-launcher", "hydra-optuna-sweeper", "wandb")


@pytest.fixture
def without(monkeypatch):
    """Pretend the modules given are not installed (every other module is)."""

    def hide(*modules):
        real = extras.installed
        monkeypatch.setattr(extras, "installed", lambda m: m not in modules and real(m))

    return hide


def test_a_plain_install_leaves_the_heavy_packages_to_extras():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    hard = {re.split(r"[<>=\[ ;]", dep)[0] for dep in project["dependencies"]}
    assert not hard & set(HEAVY)
    assert "lm-eval" in hard  # scoring any policy on any task is the mission: kept
    optional = project["optional-dependencies"]
    for _, extra, _ in extras.EXTRAS.values():  # every extra a refusal names exists
        assert extra in optional
    assert "kvcompress[launchers,wandb]" in optional["dev"]  # make install (.[dev,test]) tests them all


@pytest.mark.parametrize(
    ("args", "module", "extra"),
    [
        (["-m", "hydra/launcher=ray"], "hydra_plugins.hydra_ray_launcher", "ray"),
        (["-m", "sweep=frontier"], "hydra_plugins.hydra_optuna_sweeper", "optuna"),  # from the sweep's YAML
        (["-m", "sweep=quant_bits,frontier_duo"], "hydra_plugins.hydra_optuna_sweeper", "optuna"),
        (["-m", "hydra/launcher=slurm"], "hydra_plugins.hydra_submitit_launcher", "slurm"),
        (["logger=wandb"], "wandb", "wandb"),
    ],
)
def test_a_missing_extra_is_named(without, args, module, extra):
    assert extras.missing(args, conf_dirs()) == []  # installed here: nothing to say
    without(module)
    (said,) = extras.missing(args, conf_dirs())
    assert f"pip install 'kvcompress[{extra}]'" in said and "not installed" in said


def test_options_that_need_no_extra_pass(without):
    without("hydra_plugins.hydra_ray_launcher", "hydra_plugins.hydra_optuna_sweeper", "wandb")
    args = [
        "-m",
        "sweep=quant_bits",
        "hydra/launcher=joblib",
        "logger=jsonl",
        "policy=h2o",
        "sweep=nonexistent",
    ]
    assert extras.missing(args, conf_dirs()) == []


def test_the_command_line_refuses_before_hydra_starts(without, monkeypatch, tmp_path, capsys):
    without("hydra_plugins.hydra_optuna_sweeper")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["kvcompress", "-m", "sweep=frontier", "task.limit=1"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    said = str(exit_.value)
    assert (
        "sweep=frontier (its hydra/sweeper=optuna) needs Optuna's sweeper" in said
        and "pip install 'kvcompress[optuna]'" in said
    )
    assert not (tmp_path / "multirun").exists()  # no sweep folder: nothing ran


def test_wandb_logger_without_its_extra_is_refused_by_name(without):
    without("wandb")
    with pytest.raises(extras.MissingExtraError, match=r"pip install 'kvcompress\[wandb\]'"):
        WandbLogger()


@pytest.mark.slow
def test_a_really_missing_plugin_is_refused_by_the_console_script(tmp_path):
    """A process where the Ray plugin cannot be imported at all (as after a plain ``pip install``)."""
    script = textwrap.dedent("""
        import importlib.abc, sys
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.startswith("hydra_plugins.hydra_ray_launcher"):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Hide())
        sys.argv = ["kvcompress", "-m", "policy=full,h2o", "hydra/launcher=ray"]
        from kvcompress.harness.cli import main
        main()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "hydra/launcher=ray needs the Ray launcher" in proc.stderr
    assert "pip install 'kvcompress[ray]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "multirun").exists()
