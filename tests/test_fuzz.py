"""Property-based fuzzing of every policy over every storage: random shapes, lengths, padding, chunk sizes
and parameters. Each class declares its parameter ranges next to its code (``FUZZ``); nothing is listed
here, so a new selector or storage is fuzzed by itself.

CI runs a bounded number of examples; ``HYPOTHESIS_PROFILE=long`` runs many more locally.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import POLICY_NAMES, STORAGE_NAMES, make_tiny, max_memory_ratio, small
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompress import build_cache, make_policy
from kvcompress.policies import SchedulePolicy
from kvcompress.registry import make_storage
from kvcompress.storage.buffers import storage_bytes

settings.register_profile("ci", max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

MODEL = make_tiny("llama")


def strategy(spec):
    """A hypothesis strategy from a declared ``FUZZ``: a dict of fields, or a list of alternative dicts;
    a field is an ``(lo, hi)`` int range, a list of choices, or a fixed value."""
    if isinstance(spec, list):
        return st.one_of(*[strategy(alt) for alt in spec])
    fields = {}
    for key, value in spec.items():
        if isinstance(value, tuple):
            fields[key] = st.integers(*value)
        elif isinstance(value, list):
            fields[key] = st.sampled_from(value)
        else:
            fields[key] = st.just(value)
    return st.fixed_dictionaries(fields)


def _storage():
    """Any storage with fuzzed fields (dense included)."""
    return st.one_of(
        *[strategy(type(make_storage(n)).FUZZ).map(lambda p, n=n: {"name": n, **p}) for n in STORAGE_NAMES]
    )


def _policy(name):
    """The policy to fuzz: schedules as their small test version, others from their FUZZ, over any storage."""
    policy = make_policy(name)
    if isinstance(policy, SchedulePolicy) or not type(policy).FUZZ:
        return st.just(small(name))
    if policy.selector != name:  # a storage preset (quant, low_rank): its own fields are the storage
        return strategy(type(policy).FUZZ).map(lambda p: make_policy(name, **p))
    return st.tuples(strategy(type(policy).FUZZ), _storage()).map(
        lambda t: make_policy(name, **t[0], storage=t[1])
    )


def compresses(policy) -> bool:
    """Whether the policy must store less than ``full``: it evicts, or it keeps every token in a compressed
    storage with no per-page metadata of its own (Quest keeps every token plus page summaries, which at a
    fuzzed block_size of 1 are as large as the keys themselves)."""
    if policy.evicts != "never":
        return True
    storage = getattr(policy, "storage", None)
    no_metadata = type(policy).MAX_MEMORY_RATIO <= 1.05
    return storage is None or (storage.name != "dense" and no_metadata)


@st.composite
def cases(draw, name):
    batch = draw(st.integers(1, 2))
    length = draw(st.integers(2, 56))
    pads = [0] + [draw(st.integers(0, length - 1)) for _ in range(batch - 1)]
    try:
        policy = draw(_policy(name))
    except ValueError:
        policy = None  # invalid parameter combinations must fail at construction, clearly
    return {
        "policy": policy,
        "chunk": draw(st.integers(1, 17)),
        "ids": torch.randint(
            2, 95, (batch, length), generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))
        ),
        "pads": pads,
    }


def _stream(cache, ids, mask, chunk):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        for s in range(0, ids.shape[1], chunk):
            e = s + chunk
            out = MODEL(ids[:, s:e], attention_mask=mask[:, :e], position_ids=positions[:, s:e], cache=cache)
            assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_fuzz_policy(name):
    @given(case=cases(name))
    def check(case):
        ids, chunk, policy = case["ids"], case["chunk"], case["policy"]
        mask = torch.ones_like(ids)
        for row, pad in enumerate(case["pads"]):
            mask[row, :pad] = 0
        if policy is None:
            return
        try:
            cache = build_cache(policy, MODEL)
        except ValueError:
            return  # invalid against the model (group size vs head_dim), or a refused selector/storage pair
        full = build_cache("full", MODEL)
        try:
            _stream(cache, ids, mask, chunk)
        except ValueError as err:  # rows that cannot be compressed independently are refused by name
            assert "padding" in str(err) and ids.shape[0] > 1
            return
        _stream(full, ids, mask, chunk)
        assert cache.get_seq_length() == ids.shape[1]
        assert all(s["tokens_seen"] == ids.shape[1] for s in cache.stats())
        if compresses(policy):  # fixed per-layer state (low-rank bases) is not per-token growth
            fixed = storage_bytes(t for layer in cache.layers for t in layer.store.fixed_tensors())
            assert cache.memory_bytes() - fixed <= full.memory_bytes() * max_memory_ratio(policy)

    check()


def test_storage_state_adds_to_the_selectors_allowance(tmp_path):
    """A case the fuzzer found: H2O (score + position per token) over pre-RoPE low-rank storage that still
    holds both tokens exactly (its residual window) plus their positions: more than H2O's own allowance,
    within H2O's and the storage's together."""
    calibration = {"calibration_text": "random", "calibration_tokens": 64, "calibration_dir": str(tmp_path)}
    storage = {"name": "low_rank", "rank": 1, "residual_length": 2, "basis": "head", **calibration}
    policy = make_policy("h2o", budget=2, compression_ratio=None, observation_window=1, storage=storage)
    ids = torch.tensor([[82, 32]])
    cache, full = build_cache(policy, MODEL), build_cache("full", MODEL)
    _stream(cache, ids, torch.ones_like(ids), 1)
    _stream(full, ids, torch.ones_like(ids), 1)
    fixed = storage_bytes(t for layer in cache.layers for t in layer.store.fixed_tensors())
    ratio = (cache.memory_bytes() - fixed) / full.memory_bytes()
    assert type(policy).MAX_MEMORY_RATIO < ratio <= max_memory_ratio(policy)
