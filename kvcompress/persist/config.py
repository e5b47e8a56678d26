"""A policy as a ``_target_`` config that rebuilds it (saved with cache files), and its checked rebuild.

``describe()`` is for people and result tables; this is for machines: every dataclass field, nested
policies and storages as their own ``_target_`` configs, so ``policy_from_config`` gives an equal policy.
"""

from __future__ import annotations

import dataclasses

from kvcompress.core.policy import Policy
from kvcompress.core.storage import Storage


def policy_config(obj):
    """``obj`` (a policy, storage, or a value inside one) as plain data with ``_target_`` configs."""
    if isinstance(obj, (Policy, Storage)):
        cfg = {"_target_": f"{type(obj).__module__}.{type(obj).__qualname__}"}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name == "storage" and getattr(value, "_preset", False):
                continue  # a storage preset (quant, low_rank) rebuilds its storage from its own fields
            cfg[f.name] = policy_config(value)
        return cfg
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return {k: policy_config(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [policy_config(v) for v in obj]
    return obj


def policy_from_saved(cfg: dict) -> Policy:
    """Rebuild a ``policy_config`` read from a file; every ``_target_`` must be a kvcompress policy or storage
    class (or one registered through ``KVCOMPRESS_CONF_PATH``), never an arbitrary callable."""
    from kvcompress.core.cache import policy_from_config

    _check_targets(cfg)
    return policy_from_config(cfg)


def _check_targets(node) -> None:
    """Refuse any ``_target_`` outside kvcompress and the registered plugins before importing it, then any
    that is not a policy or storage class."""
    from kvcompress.core.registry import import_target, refuse_untrusted

    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None:
            refuse_untrusted(target, "load_cache: the saved policy's _target_")
            cls = import_target(target)
            if not (isinstance(cls, type) and issubclass(cls, (Policy, Storage))):
                raise ValueError(f"load_cache: _target_ {target!r} is not a kvcompress policy or storage")
        for value in node.values():
            _check_targets(value)
    elif isinstance(node, list):
        for value in node:
            _check_targets(value)
