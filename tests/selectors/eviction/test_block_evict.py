"""Block eviction: whole blocks only, sinks and recent window kept, best blocks chosen, exact bytes.

Layer-level tests tag every token: value channel 0 holds its position, so the stored positions can be read
back after eviction. Keys either are one-hot per block (``key[1 + pos // block_size] = 1``: a query's
entry ``1 + b`` is its logit for every token of block ``b``) or random.
"""

from __future__ import annotations

import pytest
import torch
from helpers import stream_logits
from transformers import DynamicCache

from kvcompress import build_cache
from kvcompress.core.attention import ForwardState
from kvcompress.selectors import BlockEvictPolicy, ModelSpec

D = 16
SPEC = ModelSpec(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=D, max_positions=512)


def tagged(batch: int, start: int, stop: int, block_size: int | None = None, seed: int = 0):
    """Keys and values (B, 2, stop - start, D) of positions start..stop-1; values[..., 0] = position."""
    pos = torch.arange(start, stop, dtype=torch.float32)
    if block_size is None:
        g = torch.Generator().manual_seed(seed * 1000 + start)
        keys = torch.randn(batch, 2, stop - start, D, generator=g)
    else:
        keys = torch.nn.functional.one_hot(1 + pos.long() // block_size, D).float().expand(batch, 2, -1, -1)
    values = torch.zeros(batch, 2, stop - start, D)
    values[..., 0] = pos
    return keys.clone(), values


def step(layer, keys, values, queries, padding=None) -> None:
    """Append keys/values (B, 2, q, D), then hand the layer the attention of ``queries`` (B, 4, w, D)."""
    k, _ = layer.update(keys, values, forward=ForwardState(padding))
    layer.observe_attention(queries, k, 1.0)


def positions(layer) -> list:
    """Stored real positions per row and head, ascending."""
    pos, valid = layer.values[..., 0].long(), layer.valid
    valid = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid.expand_as(pos)
    return [[p[v].tolist() for p, v in zip(pr, vr, strict=True)] for pr, vr in zip(pos, valid, strict=True)]


def span(*blocks, bs=4, n=None) -> list:
    return [t for b in blocks for t in range(b * bs, (b + 1) * bs) if n is None or t < n]


def test_prefill_keeps_the_highest_scoring_blocks_per_row_and_head():
    layer = BlockEvictPolicy(block_size=4, budget=20, sink_tokens=2, recent=4, observation_window=2)
    layer = layer.layer(0, SPEC)
    favour = [[[2, 5, 7], [1, 3, 8]], [[6, 7, 8], [4, 2, 1]]]  # row, KV head -> best blocks
    q = torch.zeros(2, 4, 2, D)
    for b, row in enumerate(favour):
        for h, blocks in enumerate(row):
            for rank, block in enumerate(blocks):  # both query heads of the KV group agree
                q[b, 2 * h : 2 * h + 2, :, 1 + block] = 6.0 - rank
    step(layer, *tagged(2, 0, 40, block_size=4), q)
    # sink block 0 and recent block 9 are protected (8 tokens); 3 more blocks fit under 20
    want = [[span(*sorted([0, 9, *blocks])) for blocks in row] for row in favour]
    assert positions(layer) == want
    assert layer.keys.shape == (2, 2, 20, D) and layer.block_scores.shape == (2, 2, 5)


@pytest.mark.parametrize("kwargs", [{"budget": 40}, {"compression_ratio": 0.5}])
def test_decode_evicts_whole_blocks_one_at_a_time_never_sinks_or_recent(kwargs):
    policy = BlockEvictPolicy(block_size=8, sink_tokens=3, recent=10, observation_window=4, **kwargs)
    layer = policy.layer(0, SPEC)
    g = torch.Generator().manual_seed(1)
    step(layer, *tagged(1, 0, 50), torch.randn(1, 4, 4, D, generator=g))
    before = layer.stored_length()
    for n in range(51, 160):
        step(layer, *tagged(1, n - 1, n), torch.randn(1, 4, 1, D, generator=g))
        stored = layer.stored_length()
        assert stored - before in (1, 1 - 8)  # one token appended, at most one block evicted
        protected = len(set(range(8)) | set(range((n - 10) // 8 * 8, n)))  # sink block + recent blocks
        assert stored <= max(policy.keep_count(n), protected)  # the target, unless protected blocks exceed it
        for kept in positions(layer)[0]:
            assert set(range(3)) | set(range(n - 10, n)) <= set(kept)  # sinks and the recent window
            for block in {t // 8 for t in kept}:  # every stored block is whole (the newest up to n)
                assert set(span(block, bs=8, n=n)) <= set(kept)
        before = stored
    assert layer.evicted > 0 and len(positions(layer)[0][0]) == stored


def test_memory_bytes_is_what_the_budget_predicts(llama):
    ids = torch.randint(2, 95, (1, 100), generator=torch.Generator().manual_seed(0))
    policy = BlockEvictPolicy(block_size=8, budget=40, sink_tokens=2, recent=8)
    cache = build_cache(policy, llama)
    stream_logits(llama, ids, cache, chunk=100)
    # protected: sink block 0 (8 tokens), recent blocks 11 and 12 (88..99: 12 tokens); (40 - 20) // 8 = 2
    stored, blocks = 8 + 12 + 2 * 8, 5
    h_kv, d = 2, 16
    per_layer = 2 * stored * h_kv * d * 4 + blocks * h_kv * 4 + 2 * 4  # K, V, block scores, 2 counters
    assert all(s["tokens_stored"] == stored and s["blocks_stored"] == blocks for s in cache.stats())
    assert cache.memory_bytes() == 3 * per_layer
    assert all(layer.keys.untyped_storage().nbytes() == layer.keys.numel() * 4 for layer in cache.layers)


@pytest.mark.parametrize("chunk", [1, 7])
def test_covering_ratio_reproduces_full_logits(chunk, llama, tokens):
    ref = stream_logits(llama, tokens, DynamicCache(config=llama.config), chunk=chunk)
    policy = BlockEvictPolicy(block_size=4, compression_ratio=0.7, sink_tokens=1, recent=2).covering(48)
    got = stream_logits(llama, tokens, build_cache(policy, llama), chunk=chunk)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_left_padded_rows_keep_what_they_keep_alone():
    policy = BlockEvictPolicy(block_size=4, budget=16, sink_tokens=1, recent=3, observation_window=3)
    pads, n0 = [0, 9], 35
    g = torch.Generator().manual_seed(2)
    steps = [(*tagged(2, 0, n0, seed=1), torch.randn(2, 4, 3, D, generator=g))]
    for n in range(n0, n0 + 14):
        steps.append((*tagged(2, n, n + 1, seed=3), torch.randn(2, 4, 1, D, generator=g)))
    alone = []
    for row, pad in enumerate(pads):  # each row alone, without its padding, positions counted from 0
        layer = policy.layer(0, SPEC)
        for i, (k, v, q) in enumerate(steps):
            cut = pad if i == 0 else 0
            step(layer, k[row : row + 1, :, cut:], v[row : row + 1, :, cut:] - pad, q[row : row + 1])
        alone.append(positions(layer)[0])
    batch, mask = policy.layer(0, SPEC), torch.ones(2, n0, dtype=torch.long)
    mask[1, : pads[1]] = 0
    for i, (k, v, q) in enumerate(steps):
        step(batch, k, v, q, padding=torch.cat([mask, torch.ones(2, i, dtype=torch.long)], 1))
    got = positions(batch)
    assert got[0] == alone[0]
    assert [[t - pads[1] for t in head] for head in got[1]] == alone[1]
    assert [len(got[0][0]), len(got[1][0])] == [13, 16]  # rows keep different counts: extra slots masked
    assert batch.keys.shape[-2] == 16
    # the host's mirror, from which every eviction count is decided, is what the device holds
    stored = batch.valid[:, 0].sum(-1).tolist()
    assert batch.rows == tuple(zip(batch.n_real.tolist(), batch.n_blocks.tolist(), stored, strict=True))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 0}, r"block_evict.block_size=0 must be an integer >= 1"),
        ({"keep_ratio": 0.5}, r"block_evict.keep_ratio was removed: use compression_ratio \(the fraction"),
        ({"window": 4}, r"block_evict.window was removed: use observation_window"),
        ({"budget": 256, "compression_ratio": 0.5}, "exactly one of budget .*compression_ratio"),
        ({"budget": 100}, r"block_evict.budget=100 is below 128 = \(sink blocks 1 \+ "),
        ({"budget": 64.5}, "block_evict.budget=64.5 must be an integer"),
        ({"sink_tokens": -1}, "block_evict.sink_tokens=-1 must be an integer >= 0"),
        ({"recent": -2}, "block_evict.recent=-2 must be an integer >= 0"),
        ({"observation_window": 0}, "block_evict.observation_window=0 must be an integer >= 1"),
    ],
)
def test_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockEvictPolicy(**kwargs)
