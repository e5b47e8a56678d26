"""Keys in one store and values in another (``kvcompress.storage.split``): each part holds its own kind of the
same tokens, and every call reaches both, so a selector sees one store: reads, evictions, crops, beams,
bytes and stats."""

from __future__ import annotations

import pytest
import torch

from kvcompress.core.buffers import storage_bytes
from kvcompress.core.plan import Latent
from kvcompress.core.spec import ModelSpec
from kvcompress.storage.dense import DenseStorage, DenseStore
from kvcompress.storage.quant.kivi import QuantStorage
from kvcompress.storage.split import SplitStore

B, H, D = 2, 2, 8
SPEC = ModelSpec(num_layers=1, num_heads=4, num_kv_heads=H, head_dim=D, max_positions=512)
INT8 = QuantStorage(bits=8, group_size=4, recent=2, key_axis="token")


def kv(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, t, D, generator=g), torch.randn(B, H, t, D, generator=g)


def split(keys_storage=None, values_storage=INT8) -> SplitStore:
    """Dense keys (or ``keys_storage``'s) with ``values_storage``'s values."""
    key_store = (keys_storage or DenseStorage()).layer(0, SPEC, ("keys",))
    return SplitStore(DenseStorage(), 0, SPEC, key_store, values_storage.layer(0, SPEC, ("values",)))


def filled(t: int, **kwargs) -> tuple[SplitStore, torch.Tensor, torch.Tensor]:
    store = split(**kwargs)
    keys, values = kv(t)
    for a in range(t):
        store.append(keys[:, :, a : a + 1], values[:, :, a : a + 1])
        store.flush()
    return store, keys, values


def test_each_part_holds_only_its_own_kind_of_the_same_tokens():
    store, keys, values = filled(10)
    assert store.key_store.read()[1] is None and store.value_store.read()[0] is None
    assert store.length == store.key_store.length == store.value_store.length == 10
    got_k, got_v = store.read()
    assert torch.equal(got_k, keys)  # dense keys: exact
    assert store.value_store.encoded_length == 8 and torch.equal(got_v[:, :, 8:], values[:, :, 8:])
    assert 0 < (got_v - values).abs().max() < 0.05  # int8 values, per token
    assert store.keys is store.key_store.keys and store.values is store.value_store.values


def test_the_bytes_held_are_both_parts_and_nothing_else():
    store, _, _ = filled(10)
    held = store.tensors()
    assert storage_bytes(held) == storage_bytes(store.key_store.tensors()) + storage_bytes(
        store.value_store.tensors()
    )
    assert storage_bytes(store.key_store.tensors()) == B * H * 10 * D * 4  # float32 keys only
    assert store.fixed_tensors() == [] and store.shared_tensors() == []


@pytest.mark.parametrize("per_head", [False, True])
def test_keep_keeps_the_same_tokens_in_both_parts(per_head):
    store, keys, values = filled(10)
    before_v = store.read()[1]
    idx = torch.tensor([[[0, 3, 8, 9]]]) if not per_head else torch.tensor([[[0, 3, 8, 9], [1, 2, 8, 9]]] * B)
    store.keep(idx)
    gather = lambda x: x.gather(2, idx.expand(B, H, -1)[..., None].expand(-1, -1, -1, D))  # noqa: E731
    got_k, got_v = store.read()
    assert store.length == 4 and torch.equal(got_k, gather(keys))
    assert torch.equal(got_v, gather(before_v))  # per-token codes gathered as they are: the same reads
    store.keep_spans([(1, 3)])
    assert torch.equal(store.read()[0], gather(keys)[:, :, 1:3]) and store.value_store.length == 2


def test_keeps_exactly_only_when_both_parts_do():
    assert split().keeps_exactly
    per_channel = QuantStorage(bits=8, group_size=4, recent=2, value_axis="channel")
    assert not per_channel.layer(0, SPEC, ("values",)).keeps_exactly
    assert not split(values_storage=per_channel).keeps_exactly


def test_a_crop_is_refused_by_either_part_and_runs_on_both():
    store, keys, values = filled(9)  # values: 4 encoded (one group), 5 exact
    assert store.crop_refusal(1) is None  # the newest token is in the value store's exact window
    refusal = store.crop_refusal(6)
    assert refusal == store.value_store.crop_refusal(6) and "exact residual window of 5" in refusal
    assert store.crop_conditions() == store.value_store.crop_conditions()
    both = split(keys_storage=INT8)
    assert both.crop_conditions() == both.key_store.crop_conditions()  # listed once, not once per part
    store.crop(1)
    assert store.key_store.length == store.value_store.length == 8
    assert torch.equal(store.read()[0], keys[:, :, :8])
    assert torch.equal(store.read()[1][:, :, 4:], values[:, :, 4:8])


def test_reorder_and_reset_reach_both_parts():
    store, keys, values = filled(6)
    beams = torch.tensor([1, 1])
    reads = store.read()
    store.reorder(beams)
    assert torch.equal(store.read()[0], keys[beams]) and torch.equal(store.read()[1], reads[1][beams])
    store.reset()
    assert store.key_store.length == store.value_store.length == 0 and store.read() == (None, None)


def test_stats_are_the_key_stores_and_the_value_stores_prefixed():
    store, _, _ = filled(10)
    stats = store.stats()
    values = store.value_store.stats()
    assert stats["storage"] == "dense" and stats["values_storage"] == "quant"
    assert all(stats[f"values_{k}"] == v for k, v in values.items() if k != "storage")
    assert stats["values_encoded_tokens"] == 8 and "encoded_tokens" not in stats  # dense keys encode nothing


class LatentKeys(DenseStore):
    """A key store read where it lies (as low-rank keys are): its latents are its dense keys here."""

    def attends_codes(self) -> bool:
        return True

    def key_read(self) -> dict:
        return {"keys": (self.keys,), "key_res": self.keys[:, :, :0], "key_decoder": torch.eye(D)[None]}


def test_the_compact_read_is_the_key_stores_latents_with_the_values_read_dense():
    key_store = LatentKeys(DenseStorage(), 0, SPEC, ("keys",))
    store = SplitStore(DenseStorage(), 0, SPEC, key_store, INT8.layer(0, SPEC, ("values",)))
    assert not split().attends_codes()  # dense keys: no compact read
    keys, values = kv(7)
    store.append(keys, values)
    store.flush()
    assert store.attends_codes()
    read = store.compact_read()
    assert isinstance(read, Latent) and read.values is None and read.keys[0] is key_store.keys
    assert torch.equal(read.value_res, store.value_store.read()[1])
