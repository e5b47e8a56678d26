"""Field declarations are the one validation layer: every declared constraint of every selector and storage
refuses bad values with a message naming the field; dataclass defaults and YAML defaults agree; deprecated
spellings still work and say what replaces them."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from conftest import POLICY_NAMES, STORAGE_NAMES

from kvcompress import make_policy
from kvcompress.core.fields import bad_values
from kvcompress.core.registry import from_name, import_target, load, make_storage

CLASSES = {f"policy/{n}": load("policy", n)["_target_"] for n in POLICY_NAMES}
CLASSES |= {f"storage/{n}": load("storage", n)["_target_"] for n in STORAGE_NAMES}
BAD = [(w, f, v) for w, target in CLASSES.items() for f, v in bad_values(import_target(target))]


def _build(where: str, **params):
    group, name = where.split("/")
    return make_policy(name, **params) if group == "policy" else make_storage({"name": name, **params})


@pytest.mark.parametrize("where,field,value", BAD, ids=[f"{w}.{f}={v!r}" for w, f, v in BAD])
def test_every_declared_field_refuses_bad_values_by_name(where, field, value):
    match = f"\\.{field}={value!r}".replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _build(where, **{field: value})


def test_bad_values_cover_every_declared_field():
    assert len(BAD) > 40  # bits, group sizes, budgets, ratios, windows, ranks...
    fields = {(w, f) for w, f, _ in BAD}
    assert ("storage/quant", "bits") in fields and ("policy/h2o", "observation_window") in fields


@pytest.mark.parametrize("where", sorted(CLASSES))
def test_dataclass_defaults_equal_the_yaml(where):
    group, name = where.split("/")
    cfg = load(group, name)
    cls = import_target(cfg.pop("_target_"))
    if group == "policy" and dataclasses.fields(cls) and "rules" in {f.name for f in dataclasses.fields(cls)}:
        pytest.skip(f"{name} is a schedule: its YAML is the whole definition")
    made = cls()
    for field, value in cfg.items():
        if field == "policy":  # PyramidKV's inner policy: a config dict in both places
            continue
        assert getattr(made, field) == (value if value is not None else getattr(made, field)), field
    assert _build(where).describe() == made.describe()


@pytest.mark.parametrize(
    "name,old,new",
    [
        ("h2o", {"window": 8}, "observation_window"),
        ("snapkv", {"window": 8}, "observation_window"),
        ("block_evict", {"window": 8}, "observation_window"),
        ("block_evict", {"keep_ratio": 0.25}, "compression_ratio"),
        ("pyramidkv", {"keep_ratio": 0.25}, "compression_ratio"),
    ],
)
def test_removed_spellings_are_refused_naming_the_new_field(name, old, new):
    (field,) = old
    with pytest.raises(ValueError, match=rf"^{name}\.{field} was removed: use {new} "):
        make_policy(name, **old)


def test_a_field_of_that_name_is_still_its_own():
    """``window`` is the sliding window's own field (its kept tokens): never refused there; a storage has no
    removed fields, so an unknown ``window`` there is just unknown."""
    assert make_policy("sliding_window", window=64).window == 64
    with pytest.raises(ValueError, match=r"storage 'quant' has no field\(s\) \['window'\]"):
        from_name("storage", "quant", {"window": 4})


def test_the_newest_exact_tokens_have_one_name_and_the_old_one_is_refused_naming_it():
    """``recent`` in selectors and storages alike; the storages' former ``residual_length`` names it."""
    from kvcompress.core.cache import make_policy as policy
    from kvcompress.core.registry import make_storage

    assert make_storage({"name": "quant", "recent": 8}).recent == 8
    for make in (
        lambda: make_storage({"name": "quant", "residual_length": 8}),
        lambda: policy("quant", residual_length=8),
        lambda: policy("full", storage={"name": "low_rank", "residual_length": 8}),
    ):
        with pytest.raises(
            ValueError, match=r"\.residual_length was removed: use recent \(the newest tokens"
        ):
            make()
