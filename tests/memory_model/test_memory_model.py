"""The memory model (``predicted_bytes``) against ``memory_bytes()`` of real caches on tiny models."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch
from conftest import POLICY_NAMES, SELECTORS, STORAGE_VARIANTS, make_tiny, small
from omegaconf import OmegaConf

from kvcompress import build_cache, compress_context, make_policy
from kvcompress.core.cache import model_spec
from kvcompress.core.registry import make_storage
from kvcompress.harness.tasks import bench
from kvcompress.memory_model import predicted_bytes

# Beyond TEST_PARAMS: the field sets each class declares for this test (``MEMORY_VARIANTS``: ratio budgets,
# slack, other quantization layouts, int8 low-rank coefficients, PyramidKV over H2O...).
VARIANTS = {n: type(make_policy(n)).MEMORY_VARIANTS for n in POLICY_NAMES}
# Every selector over every storage variant (a pair refused by build_cache is skipped by name).
PAIRS = [
    (n, {"storage": dict(v)}) for n in SELECTORS for v in STORAGE_VARIANTS.values() if v["name"] != "dense"
]
CASES = [(n, None) for n in POLICY_NAMES] + [(n, v) for n, vs in VARIANTS.items() for v in vs] + PAIRS
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CASES)]


def case_policy(name, params):
    """The small test policy (``params`` None) or the YAML policy with ``params`` replaced."""
    if params is None:
        return small(name)
    if set(params) == {"storage"}:
        return dataclasses.replace(small(name), storage=make_storage(params["storage"]))
    return dataclasses.replace(make_policy(name), **params)  # make_policy(name, policy=...) clashes


@functools.cache
def tiny(dtype):
    return make_tiny("llama", dtype=dtype)


@torch.inference_mode()
def measured_and_predicted(name, params, n_tokens, decode_tokens, dtype, batch=1):
    """memory_bytes() after one prefill and ``decode_tokens`` steps, and the memory model's prediction."""
    model = tiny(dtype)
    policy = case_policy(name, params)
    try:
        cache = build_cache(policy, model)
    except ValueError as err:
        pytest.skip(f"{name} over this storage is refused by build_cache: {err}")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 95, (batch, n_tokens + decode_tokens), generator=g)
    model(ids[:, :n_tokens], cache=cache, use_cache=True)
    try:
        compress_context(model, cache, ids[:, :n_tokens])  # query-agnostic selectors (kvzip) act here
        for t in range(n_tokens, n_tokens + decode_tokens):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    except ValueError as err:  # a compressed storage under an evicting selector refuses diverging rows
        assert "padding or rows that diverge" in str(err) and batch > 1
        pytest.skip(f"{name}: rows of this batch cannot be compressed independently over this storage")
    size = torch.empty((), dtype=dtype).element_size()
    return cache.memory_bytes(), predicted_bytes(
        policy, model_spec(model), n_tokens, size, batch, decode_tokens
    )


def spare_slot_bytes(name, params, dtype) -> int:
    """One token slot in every layer (K and V) for caches that evict in place (H2O/TOVA keep the evicted
    token's slot for the next one), else 0."""
    model = tiny(dtype)
    layers = build_cache(case_policy(name, params), model).layers
    if not any(getattr(layer, "order_free", False) for layer in layers):
        return 0
    return predicted_bytes(
        make_policy("full"), model_spec(model), 1, torch.empty((), dtype=dtype).element_size()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_long_sequences_within_headroom_of_prediction(name, params, dtype):
    measured, predicted = measured_and_predicted(name, params, 420, 13, dtype)
    if predicted is None:
        pytest.skip(f"the memory model has no formula for {name} (it returns None rather than guess)")
    # the growable buffers' headroom (t // 128 spare slots, plus the slot H2O/TOVA reuse after an in-place
    # eviction) is the only difference: 0 to 0.8% above, plus one token slot for in-place eviction
    assert predicted <= measured <= predicted * 1.008 + spare_slot_bytes(name, params, dtype)
    assert measured == pytest.approx(predicted, rel=0.02)


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_short_sequences_match_exactly(name, params):
    measured, predicted = measured_and_predicted(name, params, 70, 9, torch.float32, batch=2)
    if predicted is None:
        pytest.skip(f"the memory model has no formula for {name}")
    assert measured == predicted  # below 128 stored tokens no buffer has headroom


class CharTokenizer:
    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 90 + 2 for c in text]]))


def test_bench_rows_report_predicted_bytes(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 10)
    cfg = OmegaConf.create(
        dict(
            policies=["quant", "h2o"],
            policy_overrides={"quant": {"group_size": 4, "recent": 8}},
            peers=["dynamic"],
            lengths=[40, 300],
            text=str(text),
            decode_tokens=3,
            warmup=0,
            repeats=1,
            progress=False,
        )
    )
    model = make_tiny("llama")
    rows = bench.run(model, CharTokenizer(), None, cfg)["rows"]
    by = {(r["cache"], r["context"]): r for r in rows}
    for name in ("full", "quant", "h2o"):
        expected = predicted_bytes(
            make_policy(name, **cfg.policy_overrides.get(name, {})), model_spec(model), 300, 4, 1, 3
        )
        assert by[(name, 300)]["predicted_bytes"] == expected
        # headroom of the growable buffers (0.8%) and H2O's reused eviction slot: within the 2% target
        assert 1.0 <= by[(name, 300)]["bytes_vs_predicted"] <= 1.02
        assert by[(name, 40)]["bytes_vs_predicted"] == 1.0
    assert (
        by[("dynamic", 300)]["predicted_bytes"] is None and by[("dynamic", 300)]["bytes_vs_predicted"] is None
    )
    assert "bytes_vs_predicted" in capsys.readouterr().out.splitlines()[0]
