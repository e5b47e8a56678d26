"""Declared config fields and the one validator of every policy and storage dataclass.

A field says what it accepts next to its default (``Int(32, low=1)``, ``Float(0.5, 0, 1, high_open=True)``,
``Choice("avg", ("avg", "max"))``); ``validate`` checks them all with messages that name the field, its
value and what is allowed. Tests generate bad values from the same declarations (``bad_values``), so a
new field is validated and tested without a hand-written check or a row in a table.
"""

from __future__ import annotations

import dataclasses

_KEY = "kvc_check"


def Int(default, low: int = 0, high: int | None = None, null: bool = False):  # noqa: N802
    """An integer field in ``[low, high]`` (``None`` allowed with ``null``)."""
    return dataclasses.field(default=default, metadata={_KEY: ("int", low, high, null)})


def Float(default, low: float, high: float, low_open=False, high_open=False, null=False):  # noqa: N802
    """A number in ``[low, high]`` (open ends as asked; ``None`` allowed with ``null``)."""
    return dataclasses.field(
        default=default, metadata={_KEY: ("float", low, high, low_open, high_open, null)}
    )


def Choice(default, choices: tuple, kw_only: bool = False):  # noqa: N802
    """One of ``choices``."""
    return dataclasses.field(default=default, kw_only=kw_only, metadata={_KEY: ("choice", tuple(choices))})


def Bool(default: bool):  # noqa: N802
    return dataclasses.field(default=default, metadata={_KEY: ("bool",)})


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def problem(rule: tuple, value) -> str | None:
    """What is wrong with ``value`` under ``rule`` (a message tail), or None when it is allowed."""
    kind = rule[0]
    if kind == "int":
        _, low, high, null = rule
        if (value is None and null) or (_is_int(value) and value >= low and (high is None or value <= high)):
            return None
        return (
            f"must be an integer >= {low}"
            + (f" and <= {high}" if high is not None else "")
            + (" or null" if null else "")
        )
    if kind == "float":
        _, low, high, lo_open, hi_open, null = rule
        ok = _is_int(value) or isinstance(value, float)
        ok = (
            ok and (value > low if lo_open else value >= low) and (value < high if hi_open else value <= high)
        )
        if ok or (value is None and null):
            return None
        return f"must be in {'(' if lo_open else '['}{low:g}, {high:g}{')' if hi_open else ']'}" + (
            " or null" if null else ""
        )
    if kind == "choice":
        return None if value in rule[1] else f"is not supported; allowed: {list(rule[1])}"
    return None if isinstance(value, bool) else "must be true or false"


def validate(obj, name: str) -> None:
    """Check every declared field of dataclass ``obj``; raise ``ValueError`` naming the first bad one."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get(_KEY)
        if rule is None:
            continue
        value = getattr(obj, f.name)
        tail = problem(rule, value)
        if tail is not None:
            raise ValueError(f"{name}.{f.name}={value!r} {tail}")


def bad_values(cls) -> list[tuple[str, object]]:
    """(field, value) pairs that ``validate`` must refuse, from each declared field of ``cls``."""
    out = []
    for f in dataclasses.fields(cls):
        rule = f.metadata.get(_KEY)
        if rule is None:
            continue
        kind = rule[0]
        if kind == "int":
            out += [(f.name, rule[1] - 1), (f.name, 2.5)] + ([(f.name, None)] if not rule[3] else [])
        elif kind == "float":
            low, high = rule[1], rule[2]
            out += [(f.name, low - 1.0), (f.name, high + 1.0), (f.name, "x")]
        elif kind == "choice":
            out.append((f.name, "no-such-choice"))
        else:
            out.append((f.name, "yes"))
    return out


# Fields removed in 0.x, each with what replaced it: a config that still sets one is refused naming the new
# field (one word, one meaning: ``window`` is the sliding window's kept tokens only, ``recent`` the newest
# tokens kept exact by a selector or a storage; ``backend`` the attention backend that reads a compact cache,
# one field for quant, low_rank and block_sparse).
BACKEND = (
    "backend (auto stays auto; quant's kernel -> cpu, compile/eager -> torch; low_rank's on -> torch; "
    "off -> dense)"
)
RENAMED = {
    "policy": {
        "window": "observation_window (the prompt queries whose attention is scored)",
        "keep_ratio": "compression_ratio (the fraction removed: 1 - keep_ratio)",
        "residual_length": "recent (the newest tokens kept exact, here in the model's dtype)",  # presets
        "fused_attention": BACKEND,  # block_sparse, and the quant and low_rank presets
    },
    "storage": {
        "residual_length": "recent (the newest tokens kept exact, here in the model's dtype)",
        "fused_attention": BACKEND,
    },
}


def refuse_renamed(name: str, fields: set[str], given, group: str = "policy") -> None:
    """Raise for a removed field of ``group`` in ``given`` (keyword names) that ``fields`` (the class's own)
    lacks."""
    renamed = RENAMED[group]
    old = [k for k in given if k in renamed and k not in fields]
    if old:
        uses = "; ".join(f"{name}.{k} was removed: use {renamed[k]}" for k in old)
        raise ValueError(uses)
