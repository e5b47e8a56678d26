"""Span-aware keeping (``span``): max-pooled priorities against a float64 reference, runs kept together by
every score-based selector, and today's behaviour untouched at the default ``span: 1``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcompress import build_cache, make_policy
from kvcompress.selectors.eviction import base
from kvcompress.selectors.eviction.spans import span_pool

SELECTORS = ["snapkv", "h2o", "tova", "expected_attention", "kvzip", "pyramidkv"]


def reference(scores: torch.Tensor, span: int, free: torch.Tensor) -> torch.Tensor:
    """Loop form in float64: the best free score within ``span - 1`` tokens of each token."""
    b, h, t = scores.shape
    out = torch.full((b, h, t), -torch.inf, dtype=torch.float64)
    for i, j, x in ((i, j, x) for i in range(b) for j in range(h) for x in range(t)):
        for y in range(max(0, x - span + 1), min(t, x + span)):
            if free[i, j, y]:
                out[i, j, x] = max(out[i, j, x], float(scores[i, j, y]))
    return out


@pytest.mark.parametrize("span", [1, 2, 3, 6])
def test_pool_matches_the_float64_reference(span):
    g = torch.Generator().manual_seed(span)
    scores = torch.rand(2, 3, 17, generator=g, dtype=torch.float32)
    free = torch.rand(2, 3, 17, generator=g) > 0.2
    free[..., 0] = True  # a run that starts at a free token
    got = span_pool(scores, span, free)
    assert got.dtype == torch.float64
    if span == 1:
        assert torch.equal(got, scores.double())  # one token: its own score, not even masked
    else:
        want = reference(scores, span, free)
        assert torch.equal(got[free], want[free])  # the caller sets the others' priority
    assert torch.equal(span_pool(scores, span), reference(scores, span, torch.ones_like(free))) or span == 1


def filled(name: str, llama, tokens, **params):
    """A layer of ``name`` (span and all) that has stored ``tokens`` without evicting any."""
    cache = build_cache(make_policy(name, budget=tokens.shape[1] + 8, **params), llama)
    with torch.no_grad():
        llama(tokens, cache=cache)
    return cache.layers[0]


@pytest.mark.parametrize("span", [1, 3, 5])
def test_select_keeps_the_run_around_a_hit(llama, tokens, span):
    layer = filled("h2o", llama, tokens, recent=0, span=span)
    t = layer.stored_length()
    scores = torch.linspace(0, 0.1, t).expand(1, layer.spec.num_kv_heads, t).clone()
    scores[..., 20] = 1.0  # the hit: the first token of a value that runs on after it
    kept = layer.select(scores, 2 * span - 1)[0, 0].tolist()
    assert kept == list(range(21 - span, 20 + span))


def test_decode_evictions_keep_sequence_order_under_a_span(llama, tokens):
    cache = build_cache(make_policy("h2o", budget=20, recent=4, span=4), llama)
    with torch.no_grad():
        llama(tokens, cache=cache)
        for i in range(6):  # one eviction per step, through ``select`` (no in-place refill)
            llama(tokens[:, i : i + 1], cache=cache)
    for layer in cache.layers:
        pos = layer.positions()
        assert not layer.order_free and torch.equal(pos, pos.sort(-1).values) and pos.shape[-1] == 20


@pytest.mark.parametrize("name", SELECTORS)
def test_the_default_never_pools_and_a_span_changes_what_is_kept(llama, tokens, name, monkeypatch):
    def kept(**params):
        inner = params.pop("policy", None)  # make_policy's own first argument is named policy
        policy = make_policy(name, compression_ratio=0.6, **params)
        cache = build_cache(policy if inner is None else dataclasses.replace(policy, policy=inner), llama)
        with torch.no_grad():
            from kvcompress.runtime.context_pass import prefill

            prefill(llama, cache, tokens)
            llama(tokens[:, :1], cache=cache)
        return [layer.keys.clone() for layer in cache.layers]

    pooled = kept(**_span(name, 6))
    monkeypatch.setattr(base, "span_pool", _refuse)  # span 1 (the default): the code path of before
    default = kept(**{k: v for k, v in _span(name, 1).items() if k != "span"})
    assert any(not torch.equal(a, b) for a, b in zip(default, pooled, strict=True))


def _span(name: str, span: int) -> dict:
    """Small windows and the span setting of ``name`` (pyramidkv: in the SnapKV policy its layers run)."""
    if name == "pyramidkv":
        snap = {"_target_": "kvcompress.selectors.SnapKVPolicy", "observation_window": 4}
        return {"policy": {**snap, "span": span}}
    return {"span": span, **({"observation_window": 4} if name in ("snapkv", "h2o") else {})}


def _refuse(*args, **kwargs):
    raise AssertionError("span_pool ran with span 1")


def test_span_is_a_declared_field_of_every_score_based_selector():
    for name in ("snapkv", "h2o", "tova", "expected_attention", "kvzip"):
        assert make_policy(name).span == 1
    with pytest.raises(ValueError, match="span"):
        make_policy("snapkv", span=0)
