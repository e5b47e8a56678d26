"""A decode step's one eviction over per-token quant codes, in place (``ResidualStore.evict_one``).

H2O and TOVA evict one token per decode step. Over quant with per-token groups the store writes the window's
oldest token, encoded, into the evicted token's slot (or drops the evicted window token) instead of gathering
every code: the same tokens, the same codes and the same bytes as the ``keep`` layout, in another stored
order, with no copy of the encoded parts.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from kvcompress import build_cache
from kvcompress.selectors.eviction.scorer import ScorerLayer
from kvcompress.storage.quant.kivi import QuantStore

STORAGE = {"name": "quant", "bits": 4, "group_size": 4, "recent": 8, "key_axis": "token"}


def _decode(model, cache, prompt, steps: int) -> list[torch.Tensor]:
    """Prefill ``prompt`` (1, T), then feed ``steps`` fixed tokens one by one; each step's logits."""
    out, logits = model(prompt, cache=cache, use_cache=True), []
    for i in range(steps):
        out = model(torch.tensor([[3 + 7 * i % 90]]), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return logits


def _by_position(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored positions (B, H_kv, T) sorted, and the dequantized keys and values in that order."""
    pos = layer.positions().expand(-1, layer.spec.num_kv_heads, -1)
    order = pos.sort(dim=-1)
    keys, values = layer.store.read()
    idx = order.indices[..., None].expand(-1, -1, -1, keys.shape[-1])
    return order.values, keys.gather(2, idx), values.gather(2, idx)


@pytest.mark.parametrize("policy", ["h2o", "tova"])
@torch.inference_mode()
def test_in_place_eviction_keeps_the_same_tokens_codes_and_bytes_as_keep(policy, monkeypatch):
    model = make_tiny("llama")
    prompt = torch.randint(2, 95, (1, 40), generator=torch.Generator().manual_seed(1))
    params = {"budget": 24, "compression_ratio": None, "storage": STORAGE}
    if policy == "h2o":
        params["recent"] = 4
    else:  # TOVA keeps no positions; tracking them (unused by its choice) tells which tokens were kept
        monkeypatch.setattr(ScorerLayer, "needs_positions", True)
    fast = build_cache(policy, model, **params)
    moved = []
    evict = QuantStore.evict_one
    monkeypatch.setattr(QuantStore, "evict_one", lambda s, slot: moved.append(evict(s, slot)) or moved[-1])
    fast_logits = _decode(model, fast, prompt, 12)
    monkeypatch.setattr(QuantStore, "evict_one", lambda s, slot: None)  # the keep path, for reference
    slow = build_cache(policy, model, **params)
    slow_logits = _decode(model, slow, prompt, 12)
    assert sum(m is not None for m in moved) >= 12  # every decode step of every layer evicted in place
    for i, (a, b) in enumerate(zip(fast.layers, slow.layers, strict=True)):
        assert a.stored_length() == b.stored_length() == 24
        assert a.store.encoded_length == b.store.encoded_length  # the layout keep gives k tokens
        (pos_a, *kv_a), (pos_b, *kv_b) = _by_position(a), _by_position(b)
        assert torch.equal(pos_a, pos_b)  # the same tokens kept
        for x, y in zip(kv_a, kv_b, strict=True):
            if i == 0:  # the first layer's keys and values come from the embeddings alone: the same codes
                assert torch.equal(x, y)
            else:  # later layers' new tokens carry the earlier layers' attention, summed in another order
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert fast.memory_bytes() == slow.memory_bytes()
    for x, y in zip(fast_logits, slow_logits, strict=True):  # attention sums in another order only
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_in_place_eviction_writes_into_the_encoded_parts_without_copying_them():
    model = make_tiny("llama")
    prompt = torch.randint(2, 95, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = build_cache("h2o", model, budget=24, compression_ratio=None, recent=4, storage=STORAGE)
    _decode(model, cache, prompt, 4)
    store = cache.layers[0].store
    before = [p.data_ptr() for p in store.qkeys]
    encoded = store.encoded_length
    model(torch.tensor([[5]]), cache=cache, use_cache=True)  # one step: one token in, one evicted
    assert cache.layers[0].stored_length() == 24 and store.encoded_length == encoded
    assert [p.data_ptr() for p in store.qkeys] == before  # written where they lie, not gathered anew


def test_channel_keys_never_evict_in_place():
    """Per-channel key groups share a scale among tokens: a hole cannot take another token's codes."""
    model = make_tiny("llama")
    channel = {**STORAGE, "key_axis": "channel"}
    cache = build_cache("quant", model, **{k: v for k, v in channel.items() if k != "name"})
    store = cache.layers[0].store
    assert not store.encodes_per_token and not store.can_evict_one()
    assert store.evict_one(torch.zeros(1, 1, 1, dtype=torch.long)) is None
