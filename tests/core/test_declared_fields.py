"""Field declarations are the one validation layer: every declared constraint of every selector and storage
refuses bad values with a message naming the field; the dataclass is the one declaration of the defaults (a
YAML holds only what differs); removed spellings are refused naming what replaces them."""

from __future__ import annotations

import warnings

import pytest
from conftest import POLICY_NAMES, STORAGE_NAMES

from kvcompress import make_policy
from kvcompress.core.fields import bad_values
from kvcompress.core.registry import declared, from_name, import_target, load, make_storage, written

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
def test_a_yaml_repeats_no_default_its_dataclass_declares(where):
    """The dataclass is the one declaration of a config's fields and defaults: its YAML holds ``_target_`` and
    only values that differ (so a field added to a base class touches one file), and the whole config is
    every declared field at the YAML's value or the default; building by name gives exactly that."""
    group, name = where.split("/")
    own, whole = written(group, name), load(group, name)
    cls = import_target(own.pop("_target_"))
    defaults = declared(cls)
    repeated = {k: v for k, v in own.items() if v == defaults[k]}
    assert not repeated, f"{group}/{name}.yaml repeats its dataclass's defaults {repeated}: leave them out"
    assert whole == {"_target_": whole["_target_"], **defaults, **own} and list(whole)[1:] == list(defaults)
    by_name, by_config = _build(where).describe(), _build_from(cls, group, whole).describe()
    assert by_name | {"name": name} == by_config | {"name": name}  # a schedule's dict config is "schedule"


def _build_from(cls, group: str, cfg: dict):
    fields = {k: v for k, v in cfg.items() if k != "_target_"}
    return make_policy({"_target_": cfg["_target_"], **fields}) if group == "policy" else cls(**fields)


def test_a_plugin_yaml_of_target_and_one_changed_field_is_a_whole_config():
    """tests/plugins' vnorm YAML is two lines, ``_target_`` and its own ``recent`` (set apart from the
    default): every field it inherits (EvictionPolicy's budget, ratio, unit...) is there at its default, any
    of them overrides by name, and a name that is no field is refused, listing the real ones."""
    from kvcompress.selectors.eviction.base import EvictionPolicy

    assert written("policy", "vnorm") == {"_target_": "example_selector.VnormPolicy", "recent": 1}
    inherited = set(declared(EvictionPolicy))
    assert inherited <= set(load("policy", "vnorm")) and {"budget", "unit", "apply_to"} <= inherited
    policy = make_policy("vnorm", unit="chunk", chunk_size=4, apply_to="all")
    assert (policy.recent, policy.unit, policy.chunk_size, policy.apply_to) == (1, "chunk", 4, "all")
    assert make_policy("vnorm").recent == 1 and make_policy("vnorm", recent=3).recent == 3
    with pytest.raises(ValueError, match=r"policy 'vnorm' has no field\(s\) \['nope'\]; fields: \[.*'unit'"):
        make_policy("vnorm", nope=1)
    assert written("storage", "fp8") == {"_target_": "example_storage.Fp8Storage"}  # one line
    assert make_storage({"name": "fp8", "recent": 4}).recent == 4


def test_a_yaml_key_that_is_no_field_is_refused_naming_the_file(tmp_path, monkeypatch):
    from kvcompress.core import registry

    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "typo.yaml").write_text("_target_: kvcompress.selectors.H2OPolicy\nbudgt: 8\n")
    monkeypatch.setenv(registry.ENV, str(tmp_path))
    with pytest.raises(
        ValueError, match=r"typo.yaml sets \['budgt'\], not fields of .*H2OPolicy; its fields: "
    ):
        make_policy("typo")


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


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_policy("quant", fused_attention="kernel"),
        lambda: make_storage({"name": "quant", "fused_attention": "off"}),
        lambda: make_policy("low_rank", fused_attention="on"),
        lambda: make_policy("full", storage={"name": "low_rank", "fused_attention": "on"}),
        lambda: make_policy("block_sparse", fused_attention="off"),
        lambda: import_target("kvcompress.selectors.BlockSparsePolicy")(fused_attention="auto"),
    ],
    ids=["quant", "quant storage", "low_rank", "low_rank storage", "block_sparse", "BlockSparsePolicy"],
)
def test_fused_attention_is_refused_naming_backend_and_its_values(make):
    """quant, low_rank and block_sparse read a compact cache through one field, ``backend``."""
    values = r"\(auto stays auto; quant's kernel -> cpu, compile/eager -> torch; low_rank's on -> torch; off"
    with pytest.raises(ValueError, match=rf"^(quant|low_rank|block_sparse)\.fused_attention was removed: use "
                       rf"backend {values} -> dense\)$"):  # fmt: skip
        make()
