"""Property-based fuzzing of every policy over every storage: random shapes, lengths, padding, forward sizes
and parameters. Each class declares its parameter ranges next to its code (``FUZZ``); nothing is listed
here, so a new selector or storage is fuzzed by itself.

Only declared refusals may end an example early, each in its own situation, decided before it can happen:
a field check naming the drawn field and value, a selector/storage pair its storage ``refuses`` (which then
must be refused), and the two refusals a stream may meet (batch rows keeping different numbers of encoded
tokens; an eviction into quantized per-channel groups after decode steps). Any other exception fails.

CI runs a bounded number of examples; ``HYPOTHESIS_PROFILE=long`` runs many more locally.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from conftest import POLICY_NAMES, STORAGE_NAMES, make_tiny, max_memory_ratio, small
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompress import build_cache, make_policy
from kvcompress.core.buffers import storage_bytes
from kvcompress.core.registry import make_storage
from kvcompress.memory_model import layer_policy_of
from kvcompress.selectors import SchedulePolicy
from kvcompress.storage.quant.kivi import QuantStore

settings.register_profile("ci", max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

MODEL = make_tiny("llama")
# What a stream may be refused with, and when (``stream_refusals``).
REGROUP = r"an eviction would remove tokens from quantized groups of quant \w+_axis"


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


def _fields(name):
    """The drawn ``(fields, storage)`` of the policy to fuzz: None for schedules (their small test version),
    a storage preset's own fields (quant, low_rank: storage None), or a selector's over any storage."""
    policy = make_policy(name)
    if isinstance(policy, SchedulePolicy) or not type(policy).FUZZ:
        return st.just(None)
    if policy.selector != name:
        return strategy(type(policy).FUZZ).map(lambda p: (p, None))
    return st.tuples(strategy(type(policy).FUZZ), _storage())


def names_a_drawn_field(err: Exception, drawn) -> bool:
    """Whether ``err`` names one of the drawn fields (policy or storage) with its drawn value."""
    fields, storage = drawn or ({}, None)
    named = {**fields, **(storage or {})}
    return any(f"{k}={v!r}" in str(err) or f"{k}={v}" in str(err) for k, v in named.items())


def construct(name, drawn):
    """The drawn policy, or None when its checks refuse the drawn fields: then the message must name one of
    them with its drawn value (``h2o.budget=3 is below recent=4``)."""
    if drawn is None:
        return small(name)
    fields, storage = drawn
    try:
        return make_policy(name, **fields, **({} if storage is None else {"storage": storage}))
    except ValueError as err:
        assert names_a_drawn_field(err, drawn), err
        return None


def declared_pair_refusals(policy) -> list[str]:
    """What ``build_cache`` must refuse, from each layer's storage's own declaration (``Storage.refuses``)."""
    n = MODEL.config.num_hidden_layers
    layers = {id(p): p for p in (layer_policy_of(policy, i, n) for i in range(n))}.values()
    return [
        f"{p.selector} over storage={p.storage.name} cannot work: {why}"
        for p in layers
        if (why := p.storage.refuses(p))
    ]


def build_or_refused(policy, drawn):
    """The cache, or None when refused as declared: a pair whose storage refuses it must be refused with that
    reason; otherwise only a check against the model naming a drawn field, or the selector's own refusal of
    its drawn storage by name, may stop the build."""
    declared = declared_pair_refusals(policy)
    if declared:
        with pytest.raises(ValueError) as err:
            build_cache(policy, MODEL)
        assert str(err.value) in declared
        return None
    try:
        return build_cache(policy, MODEL)
    except ValueError as err:
        storage = getattr(policy, "storage", None)
        pair = storage is not None and str(err).startswith(
            f"{getattr(policy, 'selector', None)} over storage={storage.name} cannot work: "
        )
        assert pair or names_a_drawn_field(err, drawn), err
        return None


def _stores(store):
    """A layer's store, and the key and value stores of a split one."""
    parts = (store, getattr(store, "key_store", None), getattr(store, "value_store", None))
    return [s for s in parts if s is not None]


def stream_refusals(cache, batch: int, sizes: list[int]) -> list[str]:
    """Patterns of the refusals this stream may meet, decided before it runs:

    - a prefill-time selector over per-channel quant groups, with a multi-token forward after one-token ones:
      an eviction into quantized groups (``QuantStore.keep``)."""
    allowed = []
    evicting = [layer for layer in cache.layers if layer.policy.evicts != "never"]
    stores = [(layer, s) for layer in evicting for s in _stores(layer.store)]
    after_decode = any(a == 1 and b > 1 for i, a in enumerate(sizes) for b in sizes[i + 1 :])
    regroups = any(
        isinstance(s, QuantStore) and not s.keeps_exactly and layer.policy.evicts == "prefill"
        for layer, s in stores
    )
    if after_decode and regroups:
        allowed.append(REGROUP)
    return allowed


def forward_sizes(length: int, chunk: int, split: int, steps: int) -> list[int]:
    """Tokens per forward: ``split`` tokens in chunks of ``chunk``, ``steps`` one-token steps, the rest in
    chunks again (a question after some decoding)."""
    steps = min(steps, length - split)
    rest = length - split - steps
    return (
        [min(chunk, split - s) for s in range(0, split, chunk)]
        + [1] * steps
        + [min(chunk, rest - s) for s in range(0, rest, chunk)]
    )


@st.composite
def cases(draw, name):
    batch = draw(st.integers(1, 2))
    length = draw(st.integers(2, 56))
    pads = [0] + [draw(st.integers(0, length - 1)) for _ in range(batch - 1)]
    chunk, split = draw(st.integers(1, 17)), draw(st.integers(1, length))
    return {
        "drawn": draw(_fields(name)),
        "sizes": forward_sizes(length, chunk, split, draw(st.integers(0, 3))),
        "ids": torch.randint(
            2, 95, (batch, length), generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))
        ),
        "pads": pads,
    }


def _stream(cache, ids, mask, sizes):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        s = 0
        for n in sizes:
            e = s + n
            out = MODEL(ids[:, s:e], attention_mask=mask[:, :e], position_ids=positions[:, s:e], cache=cache)
            assert torch.isfinite(out.logits).all()
            s = e
    assert s == ids.shape[1]


def _chunks(length: int, chunk: int) -> list[int]:
    return forward_sizes(length, chunk, length, 0)


def stream_or_refused(cache, ids, mask, sizes) -> bool:
    """Stream ``ids``; False when refused by one of the refusals ``stream_refusals`` allows here."""
    allowed = stream_refusals(cache, ids.shape[0], sizes)
    try:
        _stream(cache, ids, mask, sizes)
    except ValueError as err:
        found = [m for m in (re.search(p, str(err)) for p in allowed) if m]
        if not found:
            raise
        return False
    return True


def compresses(policy) -> bool:
    """Whether the policy must store less than ``full``: it evicts, or it keeps every token in a compressed
    storage with no per-page metadata of its own (Quest keeps every token plus page summaries, which at a
    fuzzed block_size of 1 are as large as the keys themselves)."""
    if policy.evicts != "never":
        return True
    storage = getattr(policy, "storage", None)
    no_metadata = type(policy).MAX_MEMORY_RATIO <= 1.05
    return storage is None or (storage.name != "dense" and no_metadata)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_fuzz_policy(name):
    @given(case=cases(name))
    def check(case):
        ids, sizes = case["ids"], case["sizes"]
        mask = torch.ones_like(ids)
        for row, pad in enumerate(case["pads"]):
            mask[row, :pad] = 0
        policy = construct(name, case["drawn"])
        cache = None if policy is None else build_or_refused(policy, case["drawn"])
        if cache is None or not stream_or_refused(cache, ids, mask, sizes):
            return
        full = build_cache("full", MODEL)
        _stream(full, ids, mask, sizes)
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
    storage = {"name": "low_rank", "rank": 1, "recent": 2, "basis": "head", **calibration}
    policy = make_policy("h2o", budget=2, compression_ratio=None, observation_window=1, storage=storage)
    ids = torch.tensor([[82, 32]])
    cache, full = build_cache(policy, MODEL), build_cache("full", MODEL)
    _stream(cache, ids, torch.ones_like(ids), _chunks(2, 1))
    _stream(full, ids, torch.ones_like(ids), _chunks(2, 1))
    fixed = storage_bytes(t for layer in cache.layers for t in layer.store.fixed_tensors())
    ratio = (cache.memory_bytes() - fixed) / full.memory_bytes()
    assert type(policy).MAX_MEMORY_RATIO < ratio <= max_memory_ratio(policy)
