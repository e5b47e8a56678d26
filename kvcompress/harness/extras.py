"""Optional extras: the heavy launchers, sweepers and loggers are installed on demand (``pyproject.toml``'s
``[project.optional-dependencies]``), and a command that selects one that is missing is refused before any
work, naming the extra that installs it (``pip install 'kvcompress[ray]'``).

Without this check Hydra fails later with ``Could not load 'hydra/sweeper/optuna'`` or an import error of a
``hydra_plugins`` module, neither of which says what to install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import OmegaConf

# (config group, option) -> (module that provides it, extra that installs it, what it is)
_RAY = ("hydra_plugins.hydra_ray_launcher", "ray", "the Ray launcher (hydra-ray-launcher, ray)")
_SLURM = ("hydra_plugins.hydra_submitit_launcher", "slurm", "the SLURM launcher (hydra-submitit-launcher)")
_OPTUNA = ("hydra_plugins.hydra_optuna_sweeper", "optuna", "Optuna's sweeper (hydra-optuna-sweeper)")
EXTRAS = {
    ("hydra/launcher", "ray"): _RAY,
    ("hydra/launcher", "slurm"): _SLURM,
    ("hydra/launcher", "submitit_slurm"): _SLURM,
    ("hydra/launcher", "submitit_local"): _SLURM,
    ("hydra/sweeper", "optuna"): _OPTUNA,
    ("logger", "wandb"): ("wandb", "wandb", "W&B logging (wandb)"),
}
# groups whose config files may select a launcher, sweeper or logger in their defaults list
_NAMED = ("sweep", "experiment", "point")


class MissingExtraError(ImportError):
    """A command selects a launcher, sweeper or logger whose optional extra is not installed."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found, not imported: a launcher's import is slow)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def _pair(key: str, value: str) -> tuple[str, str]:
    key = key.strip().removeprefix("override").strip().lstrip("+~/")
    return key, str(value).strip()


def _from_file(group: str, name: str, dirs: list[Path]) -> list[tuple[str, str]]:
    """The (group, option) pairs the defaults list of config ``group/name`` selects, in the first folder
    of ``dirs`` that has it; none when no folder has it (Hydra then says so itself)."""
    for folder in dirs:
        path = Path(folder) / group / f"{name}.yaml"
        if path.is_file():
            try:
                defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults") or []
            except Exception:  # a file Hydra cannot read either: Hydra's own error names it
                return []
            entries = [e for e in defaults if isinstance(e, dict)]
            return [_pair(k, v) for entry in entries for k, v in entry.items() if v is not None]
    return []


def selected(overrides: list[str], dirs: list[Path]) -> list[tuple[tuple[str, str], str]]:
    """The (group, option) pairs a command line selects, each with the argument that selects it: its own
    overrides (``hydra/launcher=ray``) and the defaults of the sweep, experiment or point configs it names
    (``sweep=frontier`` selects ``hydra/sweeper=optuna``)."""
    out = []
    for arg in overrides:
        key, eq, value = arg.partition("=")
        if not eq:
            continue
        key = _pair(key, "")[0]
        for option in (o.strip() for o in value.split(",")):  # a -m sweep over several names
            out.append(((key, option), f"{key}={option}"))
            if key in _NAMED:
                out += [(pair, f"{key}={option}") for pair in _from_file(key, option, dirs)]
    return out


def missing(overrides: list[str], dirs: list[Path]) -> list[str]:
    """One sentence per selected option whose extra is not installed, naming the option and the extra."""
    out = []
    for pair, via in dict.fromkeys(selected(overrides, dirs)):
        if pair in EXTRAS and not installed(EXTRAS[pair][0]):
            _, extra, what = EXTRAS[pair]
            option = f"{pair[0]}={pair[1]}"
            named = option if via == option else f"{via} (its {option})"
            every = " (or 'kvcompress[launchers]': every launcher and sweeper)" if pair[0] != "logger" else ""
            out.append(
                f"{named} needs {what}, an optional extra that is not installed: "
                f"pip install 'kvcompress[{extra}]'{every}"
            )
    return out


def require(overrides: list[str], dirs: list[Path]) -> None:
    """Refuse a command line that selects an option whose extra is missing (``MissingExtraError``)."""
    problems = missing(overrides, dirs)
    if problems:
        raise MissingExtraError("\n".join(problems))
