"""Config groups as the registry: ``policy/<name>.yaml`` and ``storage/<name>.yaml`` under ``CONF_DIR``
(``kvcompress/conf``, inside the package, so an installed wheel knows every policy) name what exists; their
``_target_`` says which class builds it. Extra folders laid out the same way (a ``policy/`` and/or
``storage/`` subfolder) join through ``KVCOMPRESS_CONF_PATH`` (``os.pathsep``-separated) and ``./conf``
(``conf_path``: the Hydra app searches the same folders), so a new selector or storage in your own package
is one module plus one YAML.

The dataclass is the one declaration of a config's fields and defaults: a YAML holds its ``_target_`` and
only the values that differ (``load`` lays them over ``declared(cls)``), so a field added to a base class
reaches every YAML, and any field of the class can be overridden by name. The Hydra app composes the same
way (``kvcompress.harness.hydra_groups``).

A saved file (a cache file's policy and classes) may name only classes of kvcompress or of a package a
registered YAML's ``_target_`` lives in (``trusted``); anything else is refused before it is imported.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from pathlib import Path

from kvcompress.core.conf_path import CONF_DIR, ENV, conf_dirs, extra_key, import_target
from kvcompress.core.fields import refuse_renamed

__all__ = ["CONF_DIR", "ENV", "conf_dirs", "import_target"]  # where configs are searched: core.conf_path


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
    """``group/name`` as a plain dict: its ``_target_``, then every field the class declares, at the YAML's
    value where it sets one and at the dataclass default otherwise (``declared``). A clear error listing the
    known names for an unknown name, and naming the file and the class's fields for a YAML key that is not
    a field."""
    files = _files(group)
    if name not in files:
        plural = {"policy": "policies", "storage": "storages"}.get(group, group)
        raise ValueError(f"{group}={name!r} is unknown; known {plural}: {sorted(files)}")
    path = files[name]
    own = copy.deepcopy(_parsed(str(path), path.stat().st_mtime_ns))  # the caller may change its copy
    target = own.get("_target_") if isinstance(own, dict) else None
    if not isinstance(target, str):
        raise ValueError(f"{path}: a {group} YAML needs a _target_ (the class that builds it)")
    cls = import_target(target, where=str(path))  # a module that cannot be imported: named with the file
    fields = declared(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else set(own)
    stray = sorted(set(own) - names - {"_target_"})
    if stray:
        raise ValueError(f"{path} sets {stray}, not fields of {target}; its fields: {sorted(fields)}")
    return {"_target_": target, **fields, **own}


def own(group: str, name: str) -> dict:
    """The YAML of ``group/name`` as parsed, its ``_target_`` not imported (``{}`` for an unknown name)."""
    path = _files(group).get(name)
    return {} if path is None else copy.deepcopy(_parsed(str(path), path.stat().st_mtime_ns))


def _yaml_naming(group: str, target: str) -> str | None:
    """The file of the first YAML of ``group`` whose ``_target_`` is ``target`` (where its errors point)."""
    for path in _files(group).values():
        if _parsed(str(path), path.stat().st_mtime_ns).get("_target_") == target:
            return str(path)
    return None


def written(group: str, name: str) -> dict:
    """The YAML of ``group/name`` as written: its ``_target_`` and the values that differ from the declared
    defaults (``load`` gives the whole config)."""
    load(group, name)  # an unknown name or a stray key fails here, by name
    path = _files(group)[name]
    return copy.deepcopy(_parsed(str(path), path.stat().st_mtime_ns))


def declared(cls: type) -> dict:
    """The config fields ``cls`` declares, at their defaults: its dataclass fields in order, keyword-only
    ones (``apply_to``) last, without a policy's ``storage`` (its own config group) or a field with no
    default (its YAML sets it). ``{}`` for a class that is not a dataclass."""
    return copy.deepcopy(_declared(cls))  # a default list or dict is the caller's to change


@functools.lru_cache(maxsize=128)
def _declared(cls: type) -> dict:
    if not dataclasses.is_dataclass(cls):
        return {}
    fields = [f for f in dataclasses.fields(cls) if f.init and f.name != "storage"]  # a policy's storage axis
    out = {}
    for f in [f for f in fields if not f.kw_only] + [f for f in fields if f.kw_only]:
        if f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        elif f.default is not dataclasses.MISSING:  # a field with no default is its YAML's to set
            out[f.name] = f.default
    return out


def with_declared(cfg: dict) -> dict:
    """A ``{_target_: ..., field: value}`` config with every field it lacks at its declared default (a
    record written before a field existed stands at that default); ``cfg`` itself when its class does not
    import."""
    try:
        fields = declared(import_target(cfg["_target_"]))
    except (ImportError, AttributeError, ValueError, KeyError, TypeError):
        return cfg
    return {"_target_": cfg["_target_"], **fields, **cfg}


@functools.lru_cache(maxsize=256)
def _parsed(path: str, mtime_ns: int) -> dict:
    """A YAML file as a plain dict, parsed once per version of the file (``mtime_ns``): building a policy
    with the default storage reads ``storage/dense.yaml``, so this is on every policy's construction."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def trusted(path: str) -> bool:
    """Whether the dotted ``path`` (a module, or a module and a name in it) lies in kvcompress or in the
    top-level package of a ``_target_`` in a YAML of the extra config folders (``KVCOMPRESS_CONF_PATH``,
    ``./conf``)."""
    root = path.split(".")[0]
    return root == "kvcompress" or root in _plugin_roots(extra_key())


def refuse_untrusted(path: str, what: str) -> None:
    """Raise, naming ``what`` and ``path``, unless ``trusted(path)``; called before anything is imported."""
    if not isinstance(path, str) or not trusted(path):
        raise ValueError(
            f"{what} names {path!r}, which is neither a kvcompress class nor one of a plugin registered "
            f"through {ENV}: refused (nothing was imported)"
        )


@functools.lru_cache(maxsize=8)
def _plugin_roots(conf_path: str) -> frozenset[str]:
    """Top-level packages of the ``_target_``s in the YAMLs of the extra config folders (``conf_path``:
    ``conf_path.extra_key()``), read once per value."""
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
    table = _targets(group, extra_key())
    for c in cls.__mro__:
        if c in table:
            names = table[c]
            return names[0] if len(names) == 1 else None
    return None


@functools.lru_cache(maxsize=8)
def _targets(group: str, conf_path: str) -> dict[type, list[str]]:
    """``{class: [names]}`` of the YAMLs of ``group`` under the config folders of ``conf_path`` (the extra
    folders they were read under, ``extra_key``); a ``_target_`` that does not import is skipped (it fails by
    name when that config is used)."""
    out: dict[type, list[str]] = {}
    for name, path in _files(group).items():
        target = _parsed(str(path), path.stat().st_mtime_ns)
        try:
            cls = import_target(target.get("_target_"))
        except (ImportError, AttributeError, ValueError, TypeError):
            continue
        out.setdefault(cls, []).append(name)
    return out


def instantiate(cfg: dict, what: str):
    """Build ``{_target_: ..., field: value}``; ``what`` names the config in errors. A key its class does not
    declare (a Hydra ``+policy.<typo>=...``) is refused as ``from_name`` refuses it, with the fields."""
    cfg = dict(cfg)
    target = cfg.pop("_target_", None)
    if target is None:
        raise ValueError(f"{what} config needs a _target_ (got keys {sorted(cfg)})")
    cls = import_target(target, where=_yaml_naming(what, target) or f"{what} config")
    if hasattr(cls, "from_config"):
        return cls.from_config(cfg)
    if dataclasses.is_dataclass(cls):
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        own = fields - {"storage"} if what == "policy" else fields
        _refuse_unknown(what, name_of(cls, what) or cls.__name__, own, set(cfg) - fields)
    return cls(**cfg)


def _refuse_unknown(group: str, name: str, fields: set[str], unknown: set[str]) -> None:
    """Raise for keys ``unknown`` that ``group`` ``name`` (whose fields are ``fields``) does not declare: a
    removed field says what replaced it, any other lists the fields."""
    refuse_renamed(name, fields, sorted(unknown), group)
    if unknown:
        raise ValueError(f"{group} {name!r} has no field(s) {sorted(unknown)}; fields: {sorted(fields)}")


def from_name(group: str, name: str, params: dict, always: tuple = ()):
    """Instantiate ``group/name`` with field overrides ``params``: each a field its class declares (whether
    its YAML sets it or not) or one of ``always``."""
    cfg = load(group, name)
    fields = set(cfg) - {"_target_"}
    unknown = set(params) - fields - set(always)
    _refuse_unknown(group, name, fields, unknown)  # a removed field says what replaced it
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
