"""PyramidKV budgets: fixed total, shrinking with depth, and correct attention with unequal layers."""

from __future__ import annotations

import pytest
import torch
from helpers import stream_logits

from kvcompress import build_cache, make_policy
from kvcompress.selectors import FullPolicy, PyramidKVPolicy, SnapKVPolicy
from kvcompress.selectors.eviction.pyramid import pyramid_budgets, pyramid_fractions


@pytest.mark.parametrize("mean,layers,beta,reserved", [(256, 30, 20, 32), (12, 3, 4, 0), (100, 7, 2, 8)])
def test_budgets_sum_to_the_total_and_shrink_with_depth(mean, layers, beta, reserved):
    budgets = pyramid_budgets(mean, layers, beta, reserved)
    assert sum(budgets) == mean * layers
    assert all(a >= b for a, b in zip(budgets, budgets[1:], strict=False)) and budgets[0] > budgets[-1]
    assert budgets[-1] == pytest.approx(reserved + (mean - reserved) / beta, abs=1)


def test_fractions_keep_the_mean_and_cap_at_one():
    fractions = pyramid_fractions(0.75, 30, 20)
    assert sum(fractions) / 30 == pytest.approx(0.75)
    assert max(fractions) == pytest.approx(1.0) and fractions[-1] < 0.1
    assert all(a >= b - 1e-12 for a, b in zip(fractions, fractions[1:], strict=False))


def test_pyramid_builds_a_schedule_of_the_inner_policy():
    policy = make_policy("pyramidkv", budget=256, compression_ratio=None)
    budgets = policy.budgets(30)
    assert sum(budgets) == 256 * 30 and budgets[0] > budgets[-1]
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
    assert stored[0] == policy.budgets(3) and len(set(stored[0])) == 3  # e.g. [16, 10, 4]
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
