"""PyramidKV budgets: fixed total, shrinking with depth, and correct attention with unequal layers."""

from __future__ import annotations

import pytest
import torch
from helpers import stream_logits

from kvcompress import build_cache, make_policy
from kvcompress.selectors import FullPolicy, PyramidKVPolicy, SnapKVPolicy
from kvcompress.selectors.eviction.pyramid import kvpress_keep, layer_keep, reference_keep


def test_reference_schedule_follows_kvcache_factory():
    """KVCache-Factory's PyramidKVCluster at max_capacity_prompt 985, window 32, beta 20, 30 layers, 1971
    tokens: min_num = 953 // 20 = 47, max_num = 2 * 953 - 47 = 1859 (under 1971 - 32), steps = 1812 // 29 =
    62; layer i keeps 1859 - 62 i above the window."""
    keep = [reference_keep(1971, i, 30, 985, 32, 20) for i in range(30)]
    assert keep[0] == 1859 + 32 and keep[29] == 1859 - 29 * 62 + 32
    assert all(a - b == 62 for a, b in zip(keep, keep[1:], strict=False))
    # max_num capped at T - window: the first layer keeps everything, min_num takes the rest of the total
    assert reference_keep(136, 0, 2, 100, 32, 20) == 136 and reference_keep(136, 1, 2, 100, 32, 20) == 64
    assert reference_keep(150, 5, 30, 200, 32, 20) == 150  # shorter than the budget: nothing evicted
    assert reference_keep(300, 5, 30, 200, 32, 20) == 200  # under 2 (budget - window): uniform


def test_kvpress_schedule_counts_the_window_inside_the_share():
    """kvpress 0.5.5 at ratio 0.5 on 1971 tokens, window 64: from T - 64 down to 64, mean T (1 - ratio)."""
    keep = [kvpress_keep(1971, i, 30, 985.5, 64, 20) for i in range(30)]
    assert keep[0] == 1907 and keep[29] == 64
    assert sum(keep) / 30 == pytest.approx(985.5, abs=0.5)
    assert kvpress_keep(100, 3, 30, 50.0, 64, 20) == 50  # last layer under the window: uniform


@pytest.mark.parametrize("variant", ["reference", "kvpress"])
def test_pyramid_builds_a_schedule_of_the_inner_policy(variant):
    policy = make_policy("pyramidkv", compression_ratio=0.5, variant=variant)
    budgets = policy.budgets(30, 1971)
    assert budgets == [layer_keep(1971, layer=i, layers=30, budget=None, ratio=0.5, window=32, beta=20.0,
                                  variant=variant) for i in range(30)]  # fmt: skip
    assert budgets[0] > budgets[-1] >= 32
    layers = policy.schedule(30).assignment(30)
    assert all(isinstance(p, SnapKVPolicy) and p.observation_window == 32 for p in layers)


def test_unequal_layers_stay_correct_in_chunked_prefill(llama, tokens):
    """After compression every layer holds a different number of tokens; a chunk of 6 new tokens must
    then give the same logits as feeding them one by one (one shared mask would misalign layers)."""
    inner = SnapKVPolicy(budget=1, observation_window=4)
    policy = PyramidKVPolicy(policy=inner, budget=10, beta=3)
    outs, stored = [], []
    for chunk in (6, 1):
        cache = build_cache(policy, llama)
        stream_logits(llama, tokens[:, :30], cache, chunk=30)
        stored.append([layer.stored_length() for layer in cache.layers])
        outs.append(stream_logits(llama, tokens[:, 30:36], cache, chunk=chunk))
    assert stored[0] == policy.budgets(3, 30) and len(set(stored[0])) == 3  # e.g. [16, 10, 4]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_pyramid_rejects_bad_fields():
    with pytest.raises(ValueError, match="exactly one of budget"):
        PyramidKVPolicy(budget=8, compression_ratio=0.5)
    with pytest.raises(ValueError, match="pyramidkv.beta=0.5"):
        PyramidKVPolicy(budget=8, beta=0.5)
    with pytest.raises(ValueError, match="must be an eviction policy"):
        PyramidKVPolicy(policy=FullPolicy(), budget=8)
    with pytest.raises(ValueError, match="must be an eviction policy"):
        PyramidKVPolicy(policy={"_target_": "kvcompress.selectors.FullPolicy"}, budget=8)


@pytest.mark.parametrize("apply_to", ["full_attention", "all"])
def test_apply_to_reaches_every_layer_of_the_pyramid(apply_to):
    """On a hybrid model, ``apply_to`` decides who handles the windowed layers: the model's window
    (``full_attention``) or the inner selector inside it (``all``); the covering copy keeps the choice."""
    from zoo import HYBRID, make_family

    from kvcompress.core.model_window import ModelWindowLayer
    from kvcompress.selectors.eviction.snapkv import SnapKVLayer

    model = make_family("gemma3")
    policy = PyramidKVPolicy(budget=12, beta=4, apply_to=apply_to)
    for built in (policy, policy.covering(48)):
        cache = build_cache(built, model)
        for kind, layer in zip(HYBRID, cache.layers, strict=True):
            windowed = kind == "sliding_attention" and apply_to == "full_attention"
            assert isinstance(layer, ModelWindowLayer if windowed else SnapKVLayer), (kind, type(layer))
    assert ("apply_to" in policy.describe()) == (apply_to == "all")


SNAP4 = {"_target_": "kvcompress.selectors.SnapKVPolicy", "observation_window": 4}
H2O = {"_target_": "kvcompress.selectors.H2OPolicy"}


@torch.inference_mode()
def _stored_per_step(model, cache, prompt, steps) -> list[list[int]]:
    """Each layer's stored length after the prompt and after each one-token decode step."""
    model(prompt, cache=cache)
    out = [[layer.stored_length() for layer in cache.layers]]
    for i in range(steps.shape[1]):
        model(steps[:, i : i + 1], cache=cache)
        out.append([layer.stored_length() for layer in cache.layers])
    return out


def test_evict_at_defaults_to_the_inner_policys_and_records_stay_as_they_were():
    """Unset, pyramidkv evicts when its inner policy does (snapkv: prefill, the paper's) and its record
    carries no evict_at of its own: records of earlier runs describe the same policy."""
    policy = make_policy("pyramidkv")
    assert policy.evict_at is None and policy.evicts == "prefill"
    assert "evict_at" not in policy.describe() and policy.describe()["policy"]["evict_at"] == "prefill"
    assert make_policy("pyramidkv", policy=H2O).evicts == "always"  # h2o's own, as before
    set_at = make_policy("pyramidkv", evict_at="always")
    assert set_at.describe()["evict_at"] == set_at.describe()["policy"]["evict_at"] == "always"


@pytest.mark.parametrize("inner,evict_at", [(SNAP4, "always"), (SNAP4, "prefill"), (H2O, "prefill")])
def test_evict_at_reaches_every_layer_of_the_pyramid(inner, evict_at, llama, tokens):
    """prefill: each layer keeps its pyramid share of the prompt and appends decode tokens; always: a decode
    step over a layer's share of the tokens seen evicts back to it (SnapKV re-compresses, slack 0)."""
    fields = {"budget": 10, "compression_ratio": None, "beta": 3, "evict_at": evict_at}
    policy = make_policy("pyramidkv", policy=inner, **fields)
    cache = build_cache(policy, llama)
    got = _stored_per_step(llama, cache, tokens[:, :30], tokens[:, 30:36])
    want = [policy.budgets(3, 30)]
    assert len(set(want[0])) == 3  # the layers really keep different counts
    for n in range(31, 37):
        grown = [s + 1 for s in want[-1]]  # prefill: appended; always: evicted back to the layer's share
        cut = [min(s, k) for s, k in zip(grown, policy.budgets(3, n), strict=True)]
        want.append(grown if evict_at == "prefill" else cut)
    assert (want[-1] == [s + 6 for s in want[0]]) == (evict_at == "prefill")  # always: decode steps evicted
    assert got == want
    assert all(s["evict_at"] == evict_at for s in cache.stats())


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"threshold": 0.1}, r"pyramidkv.threshold=0.1 is not served: a threshold replaces the budget.*"
         r"use policy=snapkv threshold=0.1 \(snapkv.threshold\).*allowed: \[None\]"),
        ({"policy": {**SNAP4, "threshold": 0.1}}, r"pyramidkv.policy.threshold=0.1 is not served"),
        ({"evict_at": "sometimes"}, r"pyramidkv.evict_at='sometimes' is not supported; allowed: "
         r"\[None, 'prefill', 'always'\]"),
        ({"evict_at": "always", "policy": {"_target_": "kvcompress.selectors.KVzipPolicy"}},
         r"pyramidkv.evict_at='always' is not served by its policy \(kvzip.evict_at='always' is not served: "
         r".*\); allowed: \[None, 'prefill'\]$"),
        ({"evict_at": "prefill", "policy": {**SNAP4, "evict_at": "always"}},
         r"pyramidkv.evict_at='prefill' and pyramidkv.policy.evict_at='always' disagree"),
    ],
)  # fmt: skip
def test_what_pyramidkv_cannot_serve_is_refused_by_name(fields, match, llama):
    with pytest.raises(ValueError, match=match):
        build_cache("pyramidkv", llama, **fields)
