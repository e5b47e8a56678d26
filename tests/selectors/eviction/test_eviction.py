"""Eviction machinery on tiny models: exact budgets per head and row, ratios, padding, slack, checks."""

from __future__ import annotations

import pytest
import torch
from helpers import stream_logits

from kvcompress import build_cache
from kvcompress.selectors import H2OPolicy, SnapKVPolicy, TOVAPolicy


def _kept_positions(layer, full_layer) -> torch.Tensor:
    """Positions (B, H_kv, k) of the stored keys in an uncompressed run of the same single prefill."""
    dist = torch.cdist(layer.keys.float(), full_layer.keys.float())  # (B, H_kv, k, T)
    return dist.argmin(-1)


@pytest.mark.parametrize(
    "policy", [H2OPolicy(budget=10, recent=3), SnapKVPolicy(budget=10, observation_window=4)]
)
def test_keeps_exactly_budget_tokens_chosen_per_head_and_row(policy, llama):
    ids = torch.randint(2, 95, (2, 40), generator=torch.Generator().manual_seed(7))
    cache, full = build_cache(policy, llama), build_cache("full", llama)
    with torch.inference_mode():
        llama(ids, cache=cache, use_cache=True)
        llama(ids, cache=full, use_cache=True)
    for layer, ref in zip(cache.layers, full.layers, strict=True):
        assert layer.keys.shape == (2, 2, 10, 16) and layer.values.shape == (2, 2, 10, 16)
        pos = _kept_positions(layer, ref)
        torch.testing.assert_close(layer.keys, ref.keys.gather(2, pos[..., None].expand(-1, -1, -1, 16)))
        assert torch.all(pos[..., -3:] == torch.arange(37, 40))  # the protected newest tokens
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * 4  # evicted storage freed
    pos = torch.stack([_kept_positions(c, f) for c, f in zip(cache.layers, full.layers, strict=True)])
    assert not torch.equal(pos[:, 0], pos[:, 1])  # rows choose for themselves
    assert not torch.equal(pos[:, :, 0], pos[:, :, 1])  # and so do heads


def test_tova_keeps_the_same_tokens_in_every_head(llama, tokens):
    cache = build_cache(TOVAPolicy(budget=9), llama)
    stream_logits(llama, tokens, cache, chunk=5)
    layer = cache.layers[1]
    assert layer.keys.shape[-2] == 9 and cache.stats()[1]["tokens_evicted"] == 39


@pytest.mark.parametrize("cls", [H2OPolicy, TOVAPolicy])
def test_ratio_removes_that_fraction_of_tokens_seen_at_every_step(cls, llama, tokens):
    cache = build_cache(cls(compression_ratio=0.75), llama)
    stored = []
    with torch.inference_mode():
        for i in range(tokens.shape[1]):
            llama(tokens[:, i : i + 1], cache=cache, use_cache=True)
            stored.append(cache.layers[2].stored_length())
    assert stored == [max(1, n // 4) for n in range(1, 49)]


def test_snapkv_compresses_prefill_and_recompresses_decode_above_slack(llama, tokens):
    cache = build_cache(SnapKVPolicy(budget=8, observation_window=4, slack=3, evict_at="always"), llama)
    stored = []
    with torch.inference_mode():
        llama(tokens[:, :20], cache=cache, use_cache=True)
        stored.append(cache.layers[0].stored_length())
        for i in range(20, 28):
            llama(tokens[:, i : i + 1], cache=cache, use_cache=True)
            stored.append(cache.layers[0].stored_length())
    assert stored == [8, 9, 10, 11, 8, 9, 10, 11, 8]
    assert cache.layers[0].queries.shape == (1, 4, 4, 16)  # the last window queries, counted in bytes


def test_snapkv_without_slack_only_appends_during_decode(llama, tokens):
    cache = build_cache(SnapKVPolicy(compression_ratio=0.5, observation_window=4), llama)
    stream_logits(llama, tokens[:, :30], cache, chunk=30)
    stream_logits(llama, tokens[:, 30:], cache, chunk=1)
    assert [s["tokens_stored"] for s in cache.stats()] == [15 + 18] * 3


def test_padding_is_never_kept_over_real_tokens(llama):
    ids = torch.randint(2, 95, (2, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :22] = 0  # row 1 has 8 real tokens, fewer than the budget
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = build_cache(H2OPolicy(budget=12, recent=2), llama)
    with torch.inference_mode():
        llama(ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    for layer in cache.layers:
        assert layer.keys.shape[-2] == 12
        assert layer.valid[0].all() and layer.valid[1].sum(-1).tolist() == [8, 8]  # all 8 real tokens kept


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"budget": 8, "compression_ratio": 0.5}, "exactly one of budget"),
        ({"budget": 0}, "h2o.budget=0"),
        ({"budget": 2.5}, "h2o.budget=2.5"),
        ({"compression_ratio": 1.0}, r"h2o.compression_ratio=1.0 must be in \[0, 1\)"),
        ({"budget": 8, "recent": -1}, "h2o.recent=-1"),
        ({"budget": 8, "observation_window": 0}, "h2o.observation_window=0"),
        ({"budget": 8, "window": 4}, "h2o.window was removed: use observation_window"),
    ],
)
def test_h2o_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        H2OPolicy(**kwargs)


@pytest.mark.parametrize(
    "field,value,match",
    [("kernel_size", 4, "odd"), ("pooling", "median", r"allowed: \['max', 'avg'\]"), ("slack", -2, "")],
)
def test_snapkv_rejects_bad_fields(field, value, match):
    with pytest.raises(ValueError, match=f"snapkv.{field}={value!r}.*{match}"):
        SnapKVPolicy(budget=8, **{field: value})


def test_covering_turns_ratio_into_no_eviction():
    assert H2OPolicy(compression_ratio=0.5).covering(100).compression_ratio == 0.0
    assert SnapKVPolicy(budget=8).covering(100).budget == 100


@pytest.mark.parametrize("name", ["h2o", "snapkv", "tova"])
def test_ratio_sizes_each_padded_row_from_its_own_real_tokens(name, llama):
    """compression_ratio=0.5 on a left-padded batch: each row keeps half of *its* real tokens (the extra
    slots of the shorter row are masked like padding), exactly what it keeps alone."""
    from kvcompress import make_policy

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 95, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :16] = 0  # row 1: 24 real tokens
    policy = make_policy(name, compression_ratio=0.5)
    cache = build_cache(policy, llama)
    with torch.inference_mode():
        llama(ids, attention_mask=mask, cache=cache, use_cache=True)
    alone = build_cache(policy, llama)
    with torch.inference_mode():
        llama(ids[1:, 16:], cache=alone, use_cache=True)
    for layer, ref in zip(cache.layers, alone.layers, strict=True):
        real = layer.valid.sum(-1)  # (B, H_kv): real tokens each row and head keeps
        assert real[0].tolist() == [20] * real.shape[1] and real[1].tolist() == [12] * real.shape[1]
        assert ref.stored_length() == 12
