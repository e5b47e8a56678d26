"""Where configs are searched, and importing what a config's ``_target_`` names.

The package's own tree (``kvcompress/conf``, shipped in the wheel) comes first, then the folders of
``KVCOMPRESS_CONF_PATH`` (``os.pathsep``-separated; a relative folder is taken from the current directory),
then ``./conf`` when the current directory has one (a checkout's own experiment, sweep and plugin configs).
The registry (``build_cache``) and the Hydra app (``hydra.searchpath``, ``kvc_searchpath``) search the same
list, so a plugin works the same from Python and from the command line.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # kvcompress/conf: shipped in the wheel
ENV = "KVCOMPRESS_CONF_PATH"
LOCAL = "conf"  # the current directory's own config folder, searched when it exists


def extra_dirs() -> list[Path]:
    """The config folders after the package's own: ``KVCOMPRESS_CONF_PATH``'s, then ``./conf`` when it
    exists, each absolute (resolved against the current directory) and listed once."""
    listed = [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    local = Path(LOCAL)
    if local.is_dir():
        listed.append(local)
    out: list[Path] = []
    for folder in (p.resolve() for p in listed):
        if folder != CONF_DIR and folder not in out:
            out.append(folder)
    return out


def conf_dirs() -> list[Path]:
    """Every config folder, in the order a name is looked up (the first that has it wins)."""
    return [CONF_DIR, *extra_dirs()]


def extra_key() -> str:
    """The extra folders as one string: the key of caches that depend on them."""
    return os.pathsep.join(str(p) for p in extra_dirs())


def searchpath() -> list[str]:
    """The extra folders as Hydra search path entries (``file://...``): ``hydra.searchpath`` of the app's
    primary config, so ``policy=<plugin>`` needs no flag."""
    return [f"file://{p}" for p in extra_dirs()]


def import_target(target: str, where: str | None = None):
    """The object ``target`` (``package.module.Name``) names. With ``where`` (the YAML file or config that
    names it), a module that cannot be imported or a name it lacks is refused naming ``where``, the
    ``_target_`` and the module, and saying that the module must be importable."""
    module, _, attr = str(target).rpartition(".")
    if where is not None and not module:
        raise ValueError(
            f"{where}: _target_ {target!r} must name a module and a class (package.module.Class)"
        )
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if where is None:
            raise
        itself = err.name is not None and (module == err.name or module.startswith(err.name + "."))
        why = f"there is no module {err.name!r}" if itself else f"importing it failed ({err})"
        raise ModuleNotFoundError(
            f"{where}: _target_ {target!r} names module {module!r}, which cannot be imported: {why}. The "
            "module of a _target_ must be importable: install its package, or put the folder that holds it "
            "on sys.path (PYTHONPATH)",
            name=err.name,
        ) from err
    if where is not None and not hasattr(found, attr):
        raise AttributeError(
            f"{where}: _target_ {target!r}: module {module!r} ({found.__file__}) has no {attr!r}"
        )
    return getattr(found, attr)
