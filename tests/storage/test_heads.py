"""A layer's KV heads in two stores (``kvcompress.storage.heads``, DuoAttention's retrieval and streaming
heads): keys and values enter and leave as (B, H_kv, T, D) with each head in its own part; the streaming part
may hold fewer tokens, and then no selector may evict from both; every other call reaches both parts."""

from __future__ import annotations

import pytest
import torch

from kvcompress.core.buffers import storage_bytes
from kvcompress.core.plan import Dense, Heads
from kvcompress.core.spec import ModelSpec
from kvcompress.storage.dense import DenseStorage, DenseStore
from kvcompress.storage.heads import HeadSplitStore, head_index
from kvcompress.storage.quant.kivi import QuantStorage

B, H, D = 2, 4, 8
SPEC = ModelSpec(num_layers=1, num_heads=8, num_kv_heads=H, head_dim=D, max_positions=512)
SPLIT = ((0, 2), (1, 3))  # retrieval heads, streaming heads: interleaved, so the routing shows


def kv(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, t, D, generator=g), torch.randn(B, H, t, D, generator=g)


def filled(t: int, heads=SPLIT, storage=None) -> tuple[HeadSplitStore, torch.Tensor, torch.Tensor]:
    store = HeadSplitStore(storage or DenseStorage(), 0, SPEC, heads)
    keys, values = kv(t)
    store.append(keys[:, :, : t - 1], values[:, :, : t - 1])
    store.append(keys[:, :, t - 1 :], values[:, :, t - 1 :])
    return store, keys, values


def test_each_part_is_a_store_of_the_storage_for_its_own_heads():
    store = HeadSplitStore(DenseStorage(), 0, SPEC, [[torch.tensor(0), 2], [1, 3]])
    assert store.heads == SPLIT and all(type(h) is int for part in store.heads for h in part)
    for part in (store.retrieval, store.streaming):
        assert isinstance(part, DenseStore)
        spec = part.spec
        assert (spec.num_kv_heads, spec.num_heads, spec.head_dim) == (2, 4, D)  # the GQA group kept


def test_each_heads_tokens_go_to_its_part_and_come_back_in_the_models_head_order():
    store, keys, values = filled(6)
    assert torch.equal(store.retrieval.read()[0], keys[:, [0, 2]])
    assert torch.equal(store.streaming.read()[1], values[:, [1, 3]])
    got_k, got_v = store.read()
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert store.length == 6 and store.lengths() == [((0, 2), 6), ((1, 3), 6)] and store.same_lengths()


def test_trim_keeps_the_streaming_heads_sinks_and_window_and_the_read_pads_them_with_zeros():
    store, keys, values = filled(12)
    assert store.trim(2, 3) == 7  # tokens the streaming heads let go
    kept = [0, 1, 9, 10, 11]
    assert store.lengths() == [((0, 2), 12), ((1, 3), 5)] and store.length == 12 and not store.same_lengths()
    got_k, got_v = store.read()
    assert torch.equal(got_k[:, [0, 2]], keys[:, [0, 2]]) and torch.equal(got_v[:, [0, 2]], values[:, [0, 2]])
    assert torch.equal(got_k[:, [1, 3], :5], keys[:, [1, 3]][:, :, kept])
    assert torch.equal(got_v[:, [1, 3], :5], values[:, [1, 3]][:, :, kept])
    assert not got_k[:, [1, 3], 5:].any() and not got_v[:, [1, 3], 5:].any()
    assert store.trim(2, 3) == 0  # already sinks + window
    assert store.stats() == {
        "storage": "dense", "retrieval_heads": 2, "streaming_heads": 2, "tokens_per_part": [12, 5]
    }  # fmt: skip


def test_the_bytes_held_are_each_parts_own_tokens():
    store, _, _ = filled(12)
    store.trim(2, 3)
    # 2 heads in each part, keys and values, float32
    assert storage_bytes(store.tensors()) == B * 2 * (12 + 5) * 2 * D * 4


@pytest.mark.parametrize("per_head", [False, True])
def test_keep_before_the_parts_differ_gives_each_part_its_heads_tokens(per_head):
    store, keys, _ = filled(10)
    if per_head:
        idx = torch.stack([torch.tensor([h, 4 + h, 9]) for h in range(H)]).expand(B, H, 3)
    else:
        idx = torch.tensor([[[1, 5, 8]]]).expand(B, 1, 3)
    store.keep(idx)
    want = keys.gather(2, idx.expand(B, H, 3)[..., None].expand(-1, -1, -1, D))
    assert store.lengths() == [((0, 2), 3), ((1, 3), 3)] and torch.equal(store.read()[0], want)


def test_once_the_streaming_heads_hold_fewer_tokens_eviction_and_crop_are_refused_by_name():
    store, _, _ = filled(12)
    store.keep_spans([(0, 4), (8, 12)])  # still the same tokens in both parts: allowed
    assert store.lengths() == [((0, 2), 8), ((1, 3), 8)] and store.crop_refusal(1) is None
    store.trim(1, 2)
    with pytest.raises(ValueError, match="duo: the streaming heads hold fewer tokens"):
        store.keep(torch.tensor([[[0, 1]]]))
    with pytest.raises(ValueError, match="duo: the streaming heads hold fewer tokens"):
        store.keep_spans([(0, 2)])
    assert "streaming heads have evicted their older tokens" in store.crop_refusal(1)
    assert store.crop_conditions() == ["before the streaming heads evict"]
    assert store.lengths() == [((0, 2), 8), ((1, 3), 3)]  # the refusals changed nothing


def test_a_layer_with_heads_of_one_kind_holds_one_part():
    store, keys, values = filled(9, heads=((0, 1, 2, 3), ()))
    assert store.streaming is None and store.lengths() == [((0, 1, 2, 3), 9)]
    assert store.trim(1, 1) == 0  # no streaming head to trim
    assert torch.equal(store.read()[0], keys) and store.read()[0] is store.retrieval.read()[0]
    only_streaming, _, _ = filled(9, heads=((), (0, 1, 2, 3)))
    assert only_streaming.retrieval is None and only_streaming.trim(1, 1) == 7 and only_streaming.length == 2


def test_the_compact_read_is_each_parts_own_read_in_the_models_head_order():
    store, keys, values = filled(12)
    store.trim(2, 3)
    read = store.compact_read()
    assert store.attends_codes() and isinstance(read, Heads)
    (h0, r0), (h1, r1) = read.parts
    assert (h0, h1) == SPLIT and isinstance(r0, Dense) and isinstance(r1, Dense) and r0.mask is None
    assert torch.equal(r0.key, keys[:, [0, 2]])
    assert torch.equal(r1.value, values[:, [1, 3]][:, :, [0, 1, 9, 10, 11]])


def test_crop_reorder_and_reset_reach_both_parts():
    store, keys, values = filled(8)
    store.crop(3)
    assert store.lengths() == [((0, 2), 5), ((1, 3), 5)] and torch.equal(store.read()[0], keys[:, :, :5])
    beams = torch.tensor([1, 0])
    store.reorder(beams)
    assert torch.equal(store.read()[0], keys[beams, :, :5])
    assert torch.equal(store.read()[1], values[beams, :, :5])
    store.reset()
    assert store.lengths() == [((0, 2), 0), ((1, 3), 0)] and store.tensors() == [None] * 4


def test_a_flush_encodes_both_parts_of_a_compressed_storage():
    quant = QuantStorage(bits=8, group_size=4, recent=2, key_axis="token")
    store, keys, _ = filled(10, storage=quant)
    assert store.retrieval.encoded_length == store.streaming.encoded_length == 0
    store.flush()
    assert store.retrieval.encoded_length == store.streaming.encoded_length == 8
    assert store.stats()["storage"] == "quant"
    got = store.read()[0]
    assert torch.equal(got[:, :, 8:], keys[:, :, 8:])  # the window is exact in every head
    assert 0 < (got[:, :, :8] - keys[:, :, :8]).abs().max() < 0.05  # int8 codes, per head


def test_head_index_is_made_once_per_heads_and_device():
    idx = head_index((1, 3), torch.device("cpu"))
    assert idx.tolist() == [1, 3] and idx.dtype == torch.int64
    cpu = torch.device("cpu")
    assert head_index((1, 3), cpu) is idx and head_index((0, 2), cpu) is not idx
