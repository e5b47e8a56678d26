"""Dense storage (``kvcompress.storage.dense``): every kept token exactly as appended, in order; eviction
keeps exactly the chosen (row, head, token) entries; the bytes held are the tokens' bytes plus the counted
headroom; a tensor handed in by the model is never written."""

from __future__ import annotations

import pytest
import torch

from kvcompress.core.buffers import headroom, storage_bytes
from kvcompress.core.spec import ModelSpec, Shape
from kvcompress.storage.dense import DenseStorage, DenseStore

B, H, D = 2, 3, 4
SPEC = ModelSpec(num_layers=1, num_heads=6, num_kv_heads=H, head_dim=D, max_positions=512)


def kv(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (B, H, t, D), distinct random entries."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, t, D, generator=g), torch.randn(B, H, t, D, generator=g)


def store_with(t: int, kinds=("keys", "values")) -> tuple[DenseStore, torch.Tensor, torch.Tensor]:
    """A store holding ``t`` tokens appended in three steps (so its buffers are its own), and those tokens."""
    store = DenseStorage().layer(0, SPEC, kinds)
    keys, values = kv(t)
    for a, b in [(0, t // 2), (t // 2, t - 1), (t - 1, t)]:
        store.append(keys[:, :, a:b], values[:, :, a:b])
    return store, keys, values


def per_head(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Tokens ``idx`` (B, 1 or H, k) of ``x`` (B, H, T, D), the reference gather."""
    return x.gather(2, idx.expand(B, H, -1)[..., None].expand(-1, -1, -1, D))


def test_the_registry_entry_builds_a_dense_store_per_layer_and_kind():
    storage = DenseStorage()
    assert storage.name == "dense" and storage.describe() == {"name": "dense"}
    store = storage.layer(0, SPEC, ("keys",))
    assert isinstance(store, DenseStore) and store.kinds == ("keys",) and store.config is storage
    assert store.flush is None and store.keeps_exactly and store.crop_refusal(5) is None


def test_appended_tokens_are_read_back_exactly_in_order():
    store = DenseStorage().layer(0, SPEC)
    assert store.length == 0 and store.read() == (None, None)
    keys, values = kv(9)
    for a, b in [(0, 4), (4, 5), (5, 9)]:
        store.append(keys[:, :, a:b], values[:, :, a:b])
        assert store.length == b
    got_k, got_v = store.read()
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)


def test_a_store_of_one_kind_ignores_the_other():
    for kinds, index in ((("keys",), 0), (("values",), 1)):
        store, keys, values = store_with(6, kinds)
        read = store.read()
        assert store.length == 6 and read[1 - index] is None
        assert torch.equal(read[index], (keys, values)[index])
        assert storage_bytes(store.tensors()) == Shape(B, H, 6, D, 4, 6, 0).kv(6) // 2


def test_the_models_tensor_is_never_written():
    """Not even a leading slice of a longer buffer, which looks as if it had room to grow in place."""
    store = DenseStorage().layer(0, SPEC)
    buffer_k, buffer_v = kv(200)  # the model's: its first 150 tokens are handed in
    before_k, before_v = buffer_k.clone(), buffer_v.clone()
    store.append(buffer_k[:, :, :150], buffer_v[:, :, :150])
    assert not store.can_refill()  # 150 tokens would have headroom, but this buffer is the model's
    new_k, new_v = kv(5, seed=9)
    store.append(new_k[:, :, :3], new_v[:, :, :3])  # copied into a buffer of the store's own
    assert store.drop_one(torch.zeros(B, 1, 1, dtype=torch.long))
    store.crop(3)
    store.append(new_k[:, :, 3:], new_v[:, :, 3:])
    assert torch.equal(buffer_k, before_k) and torch.equal(buffer_v, before_v)
    # the newest token (new 2) moved into slot 0, the last 3 cropped, then new 3 and 4
    want = torch.cat([new_k[:, :, 2:3], before_k[:, :, 1:149], new_k[:, :, 3:]], dim=2)
    assert store.length == 151 and torch.equal(store.read()[0], want)


@pytest.mark.parametrize("heads", [1, H], ids=["shared", "per_head"])
def test_keep_keeps_exactly_the_chosen_tokens_of_each_row_and_head(heads):
    store, keys, values = store_with(20)
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(20, generator=g)[:7].sort().values for _ in range(B * heads)])
    idx = idx.view(B, heads, 7)
    store.keep(idx)
    got_k, got_v = store.read()
    assert store.length == 7
    assert torch.equal(got_k, per_head(keys, idx)) and torch.equal(got_v, per_head(values, idx))


@pytest.mark.parametrize("kept", [7, 127, 128, 300])
def test_the_bytes_held_are_the_kept_tokens_plus_their_counted_headroom(kept):
    store, keys, _ = store_with(400)
    store.keep(torch.arange(kept).view(1, 1, kept))
    spare = headroom(kept)  # 0 under 128 tokens: a small cache holds exactly its tokens
    shape = Shape(B, H, 6, D, 4, kept, 0)
    assert storage_bytes(store.tensors()) == shape.kv(kept + spare)
    assert DenseStorage().bytes_for(shape, kept) == shape.kv(kept)
    assert spare == (0 if kept < 128 else kept // 128)


def test_keep_spans_keeps_the_ranges_in_every_row_and_head():
    store, keys, values = store_with(20)
    store.keep_spans([(0, 2), (9, 12), (19, 20)])
    want = torch.tensor([0, 1, 9, 10, 11, 19])
    assert store.length == 6
    assert torch.equal(store.read()[0], keys[:, :, want]) and torch.equal(store.read()[1], values[:, :, want])


def test_keep_pairs_flattens_the_chosen_token_head_pairs_on_one_axis():
    store, keys, values = store_with(5)
    # pair t * H + h, as (t, h): row 0 (0, 0) (1, 1) (4, 2); row 1 (0, 2) (1, 0) (2, 1)
    pairs = torch.tensor([[0, 4, 14], [2, 3, 7]])
    store.keep_pairs(pairs)
    got_k, got_v = store.read()
    assert got_k.shape == (B, 1, 3, D)
    for b, row in enumerate(pairs.tolist()):
        for n, p in enumerate(row):
            t, h = divmod(p, H)
            assert torch.equal(got_k[b, 0, n], keys[b, h, t]) and torch.equal(got_v[b, 0, n], values[b, h, t])


def test_drop_one_is_refused_under_128_tokens_and_changes_nothing():
    store, keys, _ = store_with(100)
    assert not store.can_refill() and not store.can_evict_one()
    assert store.drop_one(torch.zeros(B, 1, 1, dtype=torch.long)) is False
    assert store.evict_one(torch.zeros(B, 1, 1, dtype=torch.long)) is None
    assert store.length == 100 and torch.equal(store.read()[0], keys)


def test_drop_one_moves_the_newest_token_into_each_heads_slot():
    store, keys, values = store_with(200)
    assert store.can_refill() and store.can_evict_one()
    slot = torch.tensor([[5, 0, 199], [17, 17, 3]]).view(B, H, 1)
    assert store.evict_one(slot) == 199  # the stored index that moved into the slot
    got_k, got_v = store.read()
    assert store.length == 199
    for b in range(B):
        for h in range(H):
            s = int(slot[b, h])
            order = list(range(199)) if s == 199 else [199 if i == s else i for i in range(199)]
            assert torch.equal(got_k[b, h], keys[b, h, order])
            assert torch.equal(got_v[b, h], values[b, h, order])


def test_refill_moves_the_newest_token_into_one_slot_of_every_row_and_head():
    store, keys, _ = store_with(200)
    store.refill(10)
    order = [199 if i == 10 else i for i in range(199)]
    assert store.length == 199 and torch.equal(store.read()[0], keys[:, :, order])


def test_crop_removes_the_newest_tokens_and_later_appends_fill_their_slots_in_place():
    store, keys, values = store_with(12)
    buffer = store.keys.untyped_storage().data_ptr()
    store.crop(5)
    assert store.length == 7 and torch.equal(store.read()[0], keys[:, :, :7])
    new_k, new_v = kv(2, seed=3)
    store.append(new_k, new_v)
    assert store.keys.untyped_storage().data_ptr() == buffer  # the freed slots were reused
    assert torch.equal(store.read()[0], torch.cat([keys[:, :, :7], new_k], 2))
    assert torch.equal(store.read()[1], torch.cat([values[:, :, :7], new_v], 2))


def test_reorder_takes_the_beams_rows_and_later_appends_follow_them():
    store, keys, values = store_with(6)
    beams = torch.tensor([1, 1])
    store.reorder(beams)
    assert torch.equal(store.read()[0], keys[beams]) and torch.equal(store.read()[1], values[beams])
    new_k, new_v = kv(1, seed=4)
    store.append(new_k, new_v)
    assert torch.equal(store.read()[0], torch.cat([keys[beams], new_k], 2))


def test_reset_empties_the_store():
    store, _, _ = store_with(200)
    store.reset()
    assert store.length == 0 and store.read() == (None, None) and store.tensors() == [None, None]
    assert not store.can_refill()
    keys, values = kv(3, seed=5)
    store.append(keys, values)
    assert torch.equal(store.read()[0], keys) and store.length == 3
