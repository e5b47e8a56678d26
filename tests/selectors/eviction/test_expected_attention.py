"""Expected Attention: RoPE moves, query statistics, the closed-form score, and the kept pairs on a
constructed pattern; the model's RoPE frequencies are read by build_cache."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from kvcompress import build_cache
from kvcompress.core.policy import ModelSpec
from kvcompress.selectors import ExpectedAttentionPolicy
from kvcompress.selectors.eviction.expected_attention import expected_scores, query_statistics
from kvcompress.selectors.eviction.rope import mean_rotation, rope_frequencies, rotate

D = 8
INV = 1.0 / (100.0 ** (torch.arange(0, D, 2).float() / D))  # (D/2,)


def test_mean_rotation_is_the_average_of_the_rotations():
    x = torch.randn(5, D)
    turned = torch.stack([rotate(x, j * INV) for j in range(1, 8)]).mean(0)
    torch.testing.assert_close(x @ mean_rotation(INV, 7).mT, turned, atol=1e-5, rtol=1e-5)


def test_statistics_move_every_query_to_the_last_real_position():
    base = torch.randn(D)
    q = torch.stack([rotate(base, p * INV) for p in range(6)])[None, None]  # (1, 1, 6, D) one pre-RoPE query
    weight = torch.tensor([[0.0, 1, 1, 1, 1, 1]])  # the first is a sink: left out
    mean, cov = query_statistics(q, INV, weight)
    torch.testing.assert_close(mean[0, 0], rotate(base, 5 * INV), atol=1e-5, rtol=1e-5)
    assert cov.abs().max() < 1e-5
    padded = torch.cat([torch.zeros(1, 1, 2, D), q], dim=2)  # left padding does not move the positions
    mean2, _ = query_statistics(padded, INV, torch.cat([torch.zeros(1, 2), weight], 1))
    torch.testing.assert_close(mean2, mean)


def test_closed_form_score_matches_sampled_queries():
    g = torch.Generator().manual_seed(0)
    mean, a = torch.randn(1, 1, D, generator=g), torch.randn(D, D, generator=g) * 0.5
    cov = (a @ a.T)[None, None]
    keys, values = torch.randn(1, 1, 6, D, generator=g), torch.ones(1, 1, 6, D)
    got = expected_scores(mean, cov, keys, values, 0.5, value_norm=False)
    samples = torch.distributions.MultivariateNormal(mean[0, 0], cov[0, 0]).sample((200_000,))
    mgf = torch.exp(0.5 * samples @ keys[0, 0].T).mean(0)  # E[exp(s q.k)] per key
    torch.testing.assert_close(got[0, 0], mgf / mgf.sum(), atol=2e-2, rtol=5e-2)


def test_keeps_the_keys_future_queries_will_attend_plus_sinks():
    spec = ModelSpec(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=D, max_positions=64)
    policy = ExpectedAttentionPolicy(budget=3, compression_ratio=None, sink_tokens=1, future_positions=4)
    policy.rope = [INV]
    layer = policy.layer(0, spec)
    keys = torch.randn(1, 1, 10, D, generator=torch.Generator().manual_seed(1)) * 0.1
    direction = torch.zeros(D)
    direction[0] = 1.0  # the pair that turns slowest: still aligned a few positions on
    keys[0, 0, 4], keys[0, 0, 7] = 6 * direction, -6 * direction
    query = (8 * direction).expand(1, 2, 10, D).clone()  # every query points the same way
    for p in range(10):
        query[0, :, p] = rotate(query[0, :, p], p * INV)
    k, _ = layer.update(keys, keys.clone())
    layer.observe_attention(query, k, D**-0.5)
    kept = sorted((layer.keys[0, 0] @ direction).tolist(), reverse=True)
    assert layer.stored_length() == 3 and kept[0] == pytest.approx(6.0)  # key 4 kept, key 7 (anti) gone
    assert torch.equal(layer.keys[0, 0, 0], keys[0, 0, 0])  # the sink


def test_build_cache_reads_rope_and_compresses_a_prefill():
    model = make_tiny("llama")
    freqs = rope_frequencies(model)
    assert len(freqs) == 3 and freqs[0].shape == (8,)  # head_dim 16 of the tiny model
    cache = build_cache("expected_attention", model, **ExpectedAttentionPolicy.TEST_PARAMS)
    with torch.inference_mode():
        model(torch.randint(2, 95, (1, 40)), cache=cache)
    assert all(layer.stored_length() == 12 and layer.evicted == 28 for layer in cache.layers)
    with pytest.raises(RuntimeError, match="needs the model's RoPE"):
        ExpectedAttentionPolicy().frequencies(0)
