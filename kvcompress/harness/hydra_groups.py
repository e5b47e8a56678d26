"""The Hydra side of "the dataclass is the declaration": every registered policy and storage's full config
(``registry.load``: each field its class declares, at the dataclass default unless its YAML sets it) is
stored in Hydra's ConfigStore as ``declared/policy/<name>`` and ``declared/storage/<name>``.

``kvcompress/conf/config.yaml`` puts the entry of the chosen name in its defaults list just before the
group itself, at the group's package::

    - declared/policy@policy: ${policy}
    - policy: full
    - optional declared/storage@storage: ${kvc_declared:${storage}}
    - storage: null

so the YAML (``_target_`` and what differs) merges over every declared field: ``cfg.policy`` is what it was
when each YAML listed all its fields (a run records the same config), and ``policy.<field>=value`` (or an
``-m`` sweep) overrides any field, listed in the YAML or not. The interpolation follows the group's choice
wherever it is made: the command line, ``override /policy:`` in an experiment, sweep or point. No storage
(``null``) names no entry (``kvc_declared``), which ``optional`` skips.

Why this and not one structured config per name in the ``policy`` group itself: Hydra takes a group's
option from the first source that has it, and the YAML files of ``kvcompress/conf`` come before the
ConfigStore, so a structured config of the same name would never be read. Importing this module (the app,
``kvcompress.harness.cli``, does) registers the entries; a composition without it fails by name
(``declared/policy``, ``kvc_declared``) instead of silently composing the bare YAML. Plugin names
(``KVCOMPRESS_CONF_PATH``, ``./conf``) get entries too, and config.yaml's ``hydra.searchpath``
(``kvc_searchpath``) reaches their YAMLs.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from kvcompress.core import conf_path, registry

GROUPS = ("policy", "storage")


def register() -> list[str]:
    """Store every registered name's full config under ``declared/<group>/<name>``; a name whose class does
    not import gets its YAML as written, so choosing it composes and the run refuses it by name (its YAML,
    ``_target_`` and module: ``conf_path.import_target``). Returns what it stored."""
    store, stored = ConfigStore.instance(), []
    for group in GROUPS:
        for name in registry.known(group):
            try:
                node = registry.load(group, name)
            except (ImportError, AttributeError, ValueError):  # the YAML as written: building it says why
                node = registry.own(group, name)
            store.store(group=f"declared/{group}", name=name, node=node, package=group)
            stored.append(f"{group}/{name}")
    return stored


def _choice(name) -> str:
    """A group's choice as the name of its ``declared`` entry; no choice (null) names none, so the optional
    entry is skipped."""
    return "none" if name is None else str(name)


OmegaConf.register_new_resolver("kvc_declared", _choice, replace=True)


def searchpath() -> list[str]:
    """``hydra.searchpath`` of config.yaml (``kvc_searchpath``): the folders ``build_cache`` searches beyond
    the package (``KVCOMPRESS_CONF_PATH``, ``./conf``), so ``policy=<plugin>`` needs no flag. Read before each
    composition's defaults, so it first stores the ``declared`` entries of the names the folders hold now."""
    register()
    return conf_path.searchpath()


OmegaConf.register_new_resolver("kvc_searchpath", searchpath, replace=True)
register()
