"""Config groups as the registry: ``conf/policy/<name>.yaml`` and ``conf/storage/<name>.yaml`` name what
exists, their ``_target_`` says which class builds it. Extra folders laid out the same way (a ``policy/``
and/or ``storage/`` subfolder) join through ``KVCOMPRESS_CONF_PATH`` (``os.pathsep``-separated), so a new
selector or storage in your own package is one module plus one YAML.

A saved file (a cache file's policy and classes) may name only classes of kvcompress or of a package a
registered YAML's ``_target_`` lives in (``trusted``); anything else is refused before it is imported.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
from pathlib import Path

from kvcompress.core.fields import refuse_renamed

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # kvcompress/conf: shipped in the wheel
ENV = "KVCOMPRESS_CONF_PATH"


def conf_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    return [CONF_DIR, *extra]


def _files(group: str) -> dict[str, Path]:
    found = {}
    for root in conf_dirs():
        for path in sorted((root / group).glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def known(group: str) -> list[str]:
    """Names in config group ``group`` (``policy`` or ``storage``)."""
    return sorted(_files(group))


def load(group: str, name: str) -> dict:
    """The YAML of ``group/name`` as a plain dict; a clear error listing the known names otherwise."""
    files = _files(group)
    if name not in files:
        plural = {"policy": "policies", "storage": "storages"}.get(group, group)
        raise ValueError(f"{group}={name!r} is unknown; known {plural}: {sorted(files)}")
    path = files[name]
    return copy.deepcopy(_parsed(str(path), path.stat().st_mtime_ns))  # the caller may change its copy


@functools.lru_cache(maxsize=256)
def _parsed(path: str, mtime_ns: int) -> dict:
    """A YAML file as a plain dict, parsed once per version of the file (``mtime_ns``): building a policy
    with the default storage reads ``storage/dense.yaml``, so this is on every policy's construction."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def trusted(path: str) -> bool:
    """Whether the dotted ``path`` (a module, or a module and a name in it) lies in kvcompress or in the
    top-level package of a ``_target_`` in a YAML of the extra config folders (``KVCOMPRESS_CONF_PATH``)."""
    root = path.split(".")[0]
    return root == "kvcompress" or root in _plugin_roots(os.environ.get(ENV, ""))


def refuse_untrusted(path: str, what: str) -> None:
    """Raise, naming ``what`` and ``path``, unless ``trusted(path)``; called before anything is imported."""
    if not isinstance(path, str) or not trusted(path):
        raise ValueError(
            f"{what} names {path!r}, which is neither a kvcompress class nor one of a plugin registered "
            f"through {ENV}: refused (nothing was imported)"
        )


@functools.lru_cache(maxsize=8)
def _plugin_roots(conf_path: str) -> frozenset[str]:
    """Top-level packages of the ``_target_``s in the YAMLs of the extra config folders (``conf_path``, the
    value of ``KVCOMPRESS_CONF_PATH``), read once per value."""
    from omegaconf import OmegaConf

    roots = set()
    for folder in (Path(p) for p in conf_path.split(os.pathsep) if p):
        for path in sorted(folder.glob("*/*.yaml")):
            cfg = OmegaConf.to_container(OmegaConf.load(path))
            target = cfg.get("_target_") if isinstance(cfg, dict) else None
            if isinstance(target, str):
                roots.add(target.split(".")[0])
    return frozenset(roots)


def name_of(cls: type, group: str) -> str | None:
    """The registry name of ``cls``: the one YAML of ``group`` whose ``_target_`` builds it or, for a class no
    YAML names (a test's subclass), its nearest base that one YAML names; None when none does, or when
    several YAMLs build the same class (a schedule: then the name it was made from, ``from_name``)."""
    table = _targets(group, os.environ.get(ENV, ""))
    for c in cls.__mro__:
        if c in table:
            names = table[c]
            return names[0] if len(names) == 1 else None
    return None


@functools.lru_cache(maxsize=8)
def _targets(group: str, conf_path: str) -> dict[type, list[str]]:
    """``{class: [names]}`` of the YAMLs of ``group`` under the config folders of ``conf_path`` (the value
    of ``KVCOMPRESS_CONF_PATH`` they were read under); a ``_target_`` that does not import is skipped (it
    fails by name when that config is used)."""
    out: dict[type, list[str]] = {}
    for name in known(group):
        target = load(group, name).get("_target_")
        try:
            cls = import_target(target)
        except (ImportError, AttributeError, ValueError):
            continue
        out.setdefault(cls, []).append(name)
    return out


def import_target(target: str):
    module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def instantiate(cfg: dict, what: str):
    """Build ``{_target_: ..., field: value}``; ``what`` names the config in errors."""
    cfg = dict(cfg)
    target = cfg.pop("_target_", None)
    if target is None:
        raise ValueError(f"{what} config needs a _target_ (got keys {sorted(cfg)})")
    cls = import_target(target)
    return cls.from_config(cfg) if hasattr(cls, "from_config") else cls(**cfg)


def from_name(group: str, name: str, params: dict, always: tuple = ()):
    """Instantiate ``group/name`` with field overrides ``params`` (each must be a field of its YAML)."""
    cfg = load(group, name)
    unknown = set(params) - set(cfg) - set(always)
    refuse_renamed(name, set(cfg), sorted(unknown), group)  # a removed field: say what replaced it
    if unknown:
        raise ValueError(
            f"{group} {name!r} has no field(s) {sorted(unknown)}; fields: {sorted(set(cfg) - {'_target_'})}"
        )
    made = instantiate({**cfg, **params}, group)
    if group == "policy":  # the one name of a class several YAMLs build (a schedule preset)
        made.registry_name = name
    return made


def make_storage(storage):
    """A ``Storage`` from None (dense), a name, ``{"name": ..., field: value}``, a ``_target_`` dict or
    an existing ``Storage``."""
    from kvcompress.core.storage import Storage

    if storage is None:
        return from_name("storage", "dense", {})
    if isinstance(storage, Storage):
        return storage
    if isinstance(storage, str):
        return from_name("storage", storage, {})
    if isinstance(storage, dict) or hasattr(storage, "items"):
        cfg = dict(storage)
        if "_target_" in cfg:
            cfg.pop("name", None)
            return instantiate(cfg, "storage")
        if "name" not in cfg:
            raise ValueError(f"storage={cfg!r}: give a name (one of {known('storage')}) or a _target_")
        return from_name("storage", cfg.pop("name"), cfg)
    raise ValueError(f"storage={storage!r} must be a name {known('storage')}, a dict or a Storage")
