"""The encoded region and exact residual window of compressed storages (``kvcompress.storage.residual``),
over a toy codec that rounds each element (so a read tells an encoded token from an exact one): flushes
encode the tokens that left the window, ``keep`` lays the kept tokens out as a store given only them,
positions follow the tokens, a crop is refused where it cannot be undone exactly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from kvcompress.core.buffers import storage_bytes
from kvcompress.core.spec import ModelSpec
from kvcompress.storage.residual import ResidualStore, shared_heads

B, H, D, R = 2, 2, 4, 3
SPEC = ModelSpec(num_layers=1, num_heads=4, num_kv_heads=H, head_dim=D, max_positions=512)


class Rounded(NamedTuple):
    codes: torch.Tensor  # (B, H_kv, n, D): each element rounded to an integer


class RoundStore(ResidualStore):
    """Encodes a token by rounding it; ``recent`` newest tokens stay exact. Logs every ``encode``."""

    def __init__(self, config, layer_idx, spec, kinds=("keys", "values")):
        super().__init__(config, layer_idx, spec, kinds)
        self.encoded_calls = []  # (kind, tokens, valid, positions) per encode

    def encode(self, kind, x, valid=None, positions=None):
        self.encoded_calls.append((kind, x.shape[2], valid, positions))
        return Rounded(x.round())

    def decode(self, kind, parts, out, positions=None):
        return out.copy_(parts.codes)

    def flush_count(self, residual: int) -> int:
        return residual - self.config.recent


class PositionStore(RoundStore):
    """Codes that depend on each token's position (as pre-RoPE keys do): the rounded token minus its position,
    so a token decoded at another position than it was encoded at reads back wrong."""

    needs_positions = True

    def encode(self, kind, x, valid=None, positions=None):
        self.encoded_calls.append((kind, x.shape[2], valid, positions))
        return Rounded(x.round() - positions[..., None])

    def decode(self, kind, parts, out, positions=None):
        return out.copy_(parts.codes + positions[..., None])


def make(cls=RoundStore, recent: int = R, kinds=("keys", "values")):
    return cls(SimpleNamespace(name="round", recent=recent), 0, SPEC, kinds)


def kv(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (B, H, t, D) with no integer entries (rounding changes every element)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(B, H, t, D, generator=g) * 10 + 0.25, torch.rand(B, H, t, D, generator=g) * 10 + 0.25)


def stream(store, keys, values, flush=True, **kwargs) -> None:
    """Append the tokens one step at a time, flushing after each step as a layer does."""
    for t in range(keys.shape[2]):
        store.append(keys[:, :, t : t + 1], values[:, :, t : t + 1], **kwargs)
        if flush:
            store.flush()


def layout(x: torch.Tensor, encoded: int) -> torch.Tensor:
    """``x`` as a store reads it when its first ``encoded`` tokens are encoded and the rest exact."""
    return torch.cat([x[:, :, :encoded].round(), x[:, :, encoded:]], dim=2)


def test_each_flush_encodes_the_tokens_that_left_the_window_and_reads_them_back_encoded():
    store = make()
    keys, values = kv(9)
    for t in range(1, 10):
        store.append(keys[:, :, t - 1 : t], values[:, :, t - 1 : t])
        assert (store.encoded_length, store.residual_length) == (max(0, t - 1 - R), min(t, R + 1))
        store.flush()
        te = max(0, t - R)
        assert (store.encoded_length, store.residual_length, store.length) == (te, t - te, t)
        got_k, got_v = store.read()
        assert torch.equal(got_k, layout(keys[:, :, :t], te))
        assert torch.equal(got_v, layout(values[:, :, :t], te))
    assert [n for _, n, _, _ in store.encoded_calls] == [1] * 12  # each token encoded once, per kind
    assert store.stats() == {"storage": "round", "encoded_tokens": 6, "exact_window": R}


def test_nothing_is_encoded_before_tokens_leave_the_window():
    store = make(recent=10)
    keys, values = kv(8)
    stream(store, keys, values)
    assert store.encoded_length == 0 and store.encoded["keys"] is None and store.encoded_calls == []
    assert torch.equal(store.read()[0], keys)


def test_a_flush_passes_the_validity_of_the_tokens_it_encodes():
    store = make(recent=2)
    keys, values = kv(7)
    store.append(keys, values)
    valid = torch.arange(7).expand(B, 1, 7) % 3 != 0  # (B, 1, T): a padding pattern to recognise
    store.flush(valid)
    assert store.encoded_length == 5
    assert all(torch.equal(v, valid[..., :5]) for _, _, v, _ in store.encoded_calls)
    store.append(*kv(1, seed=1))
    store.flush(valid=torch.arange(8).expand(B, 1, 8) != 5)  # the one token encoded now is token 5
    _, n, valid, _ = store.encoded_calls[-1]
    assert n == 1 and valid.tolist() == [[[False]]] * B


def test_a_store_of_one_kind_encodes_and_reads_only_that_kind():
    store = make(kinds=("values",))
    keys, values = kv(6)
    stream(store, keys, values)
    read_k, read_v = store.read()
    assert read_k is None and torch.equal(read_v, layout(values, 6 - R))
    assert {kind for kind, *_ in store.encoded_calls} == {"values"} and store.encoded_length == 6 - R


@pytest.mark.parametrize(
    "kept,unflushed",
    [([0, 2, 7, 8], 0), ([1, 2, 3, 4, 5, 6, 8], 0), ([5, 6, 7, 8], 0)]
    + [([0, 7, 8, 9, 10], 2), ([6, 7, 8, 9, 10], 2)],
)
def test_keep_lays_the_kept_tokens_out_as_a_store_given_only_them(kept, unflushed):
    """The first ``flush_count(k)`` kept tokens are encoded (a kept window token there is encoded now), the
    rest are the window (a kept encoded token there is its reconstruction); ``unflushed`` tokens of the step
    wait in the window past ``recent``."""
    store = make()
    keys, values = kv(9 + unflushed)
    stream(store, keys[:, :, :9], values[:, :, :9])
    store.append(keys[:, :, 9:], values[:, :, 9:])
    te = store.encoded_length  # 6: tokens 0..5 encoded, the others exact
    store.encoded_calls.clear()
    store.keep(torch.tensor(kept).view(1, 1, -1))
    n_enc = len(kept) - R
    assert (store.encoded_length, store.residual_length) == (n_enc, R)
    for x, got in zip((keys, values), store.read(), strict=True):
        want = [x[:, :, t].round() if i < n_enc or t < te else x[:, :, t] for i, t in enumerate(kept)]
        assert torch.equal(got, torch.stack(want, dim=2))
    encoding = any(t >= te for t in kept[:n_enc])  # a window token lands in the encoded region
    assert [kind for kind, *_ in store.encoded_calls] == (["keys", "values"] if encoding else [])
    assert isinstance(store.encoded["keys"], Rounded)  # the codec's own tuple type survives the gather


def test_keep_per_head_keeps_each_heads_own_tokens():
    store = make()
    keys, values = kv(9)
    stream(store, keys, values)
    idx = torch.tensor([[[0, 4, 6, 7, 8], [1, 2, 3, 5, 8]], [[2, 3, 4, 5, 6], [0, 1, 6, 7, 8]]])
    store.keep(idx)
    assert (store.encoded_length, store.residual_length) == (2, R)
    got = store.read()[0]
    for b in range(B):
        for h in range(H):
            # the first two kept are encoded; after them a token of the old window (>= 6) stays exact
            kept = idx[b, h].tolist()
            want = torch.stack(
                [keys[b, h, t].round() if i < 2 or t < 6 else keys[b, h, t] for i, t in enumerate(kept)]
            )
            assert torch.equal(got[b, h], want)


def test_before_any_encoding_keep_leaves_every_kept_token_exact():
    """A prompt a prefill-time selector evicts stays exact until the layer's flush encodes it."""
    store = make()
    keys, values = kv(9)
    stream(store, keys, values, flush=False)
    store.keep(torch.tensor([0, 3, 4, 5, 8]).view(1, 1, -1))
    assert (store.encoded_length, store.residual_length) == (0, 5) and store.encoded_calls == []
    store.flush()
    assert store.encoded_length == 2
    assert torch.equal(store.read()[0], layout(keys[:, :, [0, 3, 4, 5, 8]], 2))


def test_positions_follow_the_tokens_and_reach_the_codec():
    store = make(PositionStore)
    keys, values = kv(8)
    for t in range(8):  # a prompt starting at position 100, as the model numbered it
        store.append(keys[:, :, t : t + 1], values[:, :, t : t + 1], torch.tensor([[100 + t]]))
        store.flush()
    assert store.positions.dtype == torch.int32 and store.positions.shape == (B, H, 8)
    assert store.positions[0, 0].tolist() == list(range(100, 108))
    given = [p.tolist() for _, _, _, p in store.encoded_calls[::2]]  # the keys' encodes, one token each
    assert given == [[[[100 + t]] * H] * B for t in range(5)]
    assert torch.equal(store.read()[0], layout(keys, 5))  # decoded at the positions it was encoded at
    store.keep(torch.tensor([1, 2, 4, 6, 7]).view(1, 1, -1))
    assert store.positions[1, 1].tolist() == [101, 102, 104, 106, 107]
    # 1, 2 stay encoded; 4, encoded, lands in the window as its reconstruction (decoded at position 104)
    assert torch.equal(store.read()[0], layout(keys[:, :, [1, 2, 4, 6, 7]], 3))


def test_without_given_positions_they_count_the_tokens_appended():
    store = make(PositionStore)
    stream(store, *kv(5))
    assert store.positions[1, 0].tolist() == [0, 1, 2, 3, 4]
    store.reset()
    stream(store, *kv(2))
    assert store.positions[0, 1].tolist() == [0, 1] and store.appended == 2


def test_the_bytes_held_are_the_encoded_parts_the_window_and_the_positions():
    store = make(PositionStore)
    stream(store, *kv(9))
    held = store.tensors()
    assert any(t is store.positions for t in held) and any(t is store.encoded["values"].codes for t in held)
    n = B * H * 4  # bytes of one float32 element in every row and head
    want = 2 * 6 * D * n + 2 * R * D * n + 9 * B * H * 4  # codes and window of both kinds, int32 positions
    assert storage_bytes(held) == want


def test_encoded_parts_grown_in_place_equal_concatenated_ones():
    stores = [make(), make()]
    stores[1].grows_in_place = True
    keys, values = kv(1100)
    for store in stores:
        store.append(keys[:, :, :1000], values[:, :, :1000])
        store.flush()
    in_place = [0, 0]  # steps whose flush left the encoded keys in the buffer they were in
    for t in range(1000, 1100):
        for i, store in enumerate(stores):
            before = store.encoded["keys"].codes.data_ptr()
            store.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
            store.flush()
            in_place[i] += store.encoded["keys"].codes.data_ptr() == before
    assert all(torch.equal(a, b) for a, b in zip(stores[0].read(), stores[1].read(), strict=True))
    assert isinstance(stores[1].encoded["keys"], Rounded)
    assert in_place[0] == 0 and in_place[1] >= 80  # a spare slot per 128 tokens: a copy every ~8 steps


def test_crop_of_window_tokens_is_exact_and_refused_once_they_pushed_older_ones_out():
    store = make(recent=4)
    keys, values = kv(10)
    stream(store, keys[:, :, :6], values[:, :, :6])  # 2 encoded, 4 in the window
    assert store.crop_refusal(5) is not None and "exact residual window of 4" in store.crop_refusal(5)
    store.append(keys[:, :, 6:8], values[:, :, 6:8])  # not flushed yet: 6 in the window
    assert store.crop_refusal(2) is None
    store.flush()  # tokens 6, 7 pushed 2 and 3 into the encoded region
    assert "pushed older tokens out" in store.crop_refusal(2)
    fresh = make(recent=4)
    stream(fresh, keys[:, :, :6], values[:, :, :6])
    fresh.append(keys[:, :, 6:8], values[:, :, 6:8])
    fresh.crop(2)  # before its flush: as if 6 and 7 had never come
    assert fresh.appended == 6 and fresh.length == 6
    assert torch.equal(fresh.read()[0], layout(keys[:, :, :6], 2))
    fresh.flush()
    assert fresh.encoded_length == 2


def test_evict_one_fills_an_encoded_hole_with_the_windows_oldest_token_encoded():
    store = make()
    store.encodes_per_token = True
    keys, values = kv(9)
    stream(store, keys[:, :, :8], values[:, :, :8])  # 5 encoded, 3 in the window
    store.append(keys[:, :, 8:], values[:, :, 8:])  # the step's token: 4 in the window
    assert store.can_evict_one()
    slot = torch.tensor([[[2], [6]], [[7], [0]]])  # (B, H_kv, 1): encoded holes 2 and 0, window 6 and 7
    moved = store.evict_one(slot)
    assert torch.equal(moved, torch.tensor([[[5], [6]], [[7], [5]]]))
    assert (store.encoded_length, store.residual_length) == (5, 3)
    got = store.read()[0]
    for b in range(B):
        for h in range(H):
            s, order = int(slot[b, h]), list(range(9))
            if s < 5:  # the window's oldest (5) is encoded into the hole
                order = [5 if i == s else i for i in range(5)] + [6, 7, 8]
            else:
                order.remove(s)
            assert torch.equal(got[b, h], layout(keys[b : b + 1, h : h + 1, order], 5)[0, 0])


def test_evict_one_is_refused_where_positions_are_kept_or_the_layout_would_differ():
    store = make(PositionStore)
    store.encodes_per_token = True
    stream(store, *kv(8))
    store.append(*kv(1, seed=1))
    assert not store.can_evict_one() and store.evict_one(torch.zeros(1, 1, 1, dtype=torch.long)) is None
    flushed = make()
    flushed.encodes_per_token = True
    stream(flushed, *kv(8))  # flushed: one eviction would leave the window a token short of ``keep``'s
    assert flushed.can_evict_one() and flushed.evict_one(torch.zeros(1, 1, 1, dtype=torch.long)) is None
    assert flushed.length == 8


def test_reorder_takes_every_parts_rows_and_reset_empties_the_store():
    store = make(PositionStore)
    keys, values = kv(7)
    stream(store, keys, values)
    beams = torch.tensor([1, 1])
    store.reorder(beams)
    assert torch.equal(store.read()[0], layout(keys, 4)[beams]) and store.positions.shape[0] == 2
    store.reset()
    assert store.length == 0 and store.read() == (None, None) and store.positions is None
    assert store.encoded == {"keys": None, "values": None} and store.flushes == []


def test_shared_heads_gives_each_block_of_heads_its_tokens_or_refuses_per_head_choices():
    idx = torch.tensor([[[0, 2, 5]]])
    assert torch.equal(shared_heads(idx, 2), idx.expand(1, 2, 3))
    per_head = torch.tensor([[[0, 2], [1, 3], [1, 3], [0, 2]]])
    assert torch.equal(shared_heads(per_head, 4), per_head)
    blocks = torch.tensor([[[0, 2], [0, 2], [1, 3], [1, 3]]])
    assert torch.equal(shared_heads(blocks, 2), torch.tensor([[[0, 2], [1, 3]]]))
    with pytest.raises(ValueError, match="2 KV heads.*cannot keep different tokens.*use basis=head"):
        shared_heads(per_head, 2)
