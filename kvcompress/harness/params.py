"""The ``params`` column of a results table: the fields a run's policy and storage really had."""

from __future__ import annotations


def _effective(config: dict) -> dict:
    """The policy's fields as its dataclass resolved them (a null ``compression_ratio`` is 0.5), or {} when
    the record's policy cannot be built here (a plugin not importable, a field since renamed)."""
    from kvcompress.core.cache import make_policy

    try:
        policy = make_policy(dict(config["policy"]), storage=config.get("storage") or None)
    except (ValueError, TypeError, KeyError, ImportError, AttributeError):  # shown as written instead
        return {}
    return policy.describe()


def params_text(config: dict) -> str:
    """``field=value`` of the policy (a null field as the policy resolved it), then ``storage.field=value``
    of the storage group's fields, so two runs that differ only in their storage differ in the table."""
    policy = {k: v for k, v in dict(config.get("policy") or {}).items() if k != "_target_"}
    storage = {k: v for k, v in dict(config.get("storage") or {}).items() if k != "_target_"}
    effective = _effective(config) if any(v is None for v in policy.values()) else {}
    fields = [f"{k}={effective.get(k) if v is None else v}" for k, v in policy.items()]
    return " ".join(fields + [f"storage.{k}={v}" for k, v in storage.items()])
