"""Growable storage: appends land in place, eviction copies exactly the kept rows, foreign tensors are
never written, and the headroom is real memory that ``memory_bytes()`` counts."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from transformers import DynamicCache

from kvcompress import build_cache
from kvcompress.core.buffers import Slots, gather_pages, gather_tokens, headroom
from kvcompress.core.policy import PolicyLayer


def _tokens(b=2, h=3, t=300, d=8, seed=0):
    return torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed))


def test_extend_matches_cat_and_reuses_the_buffer():
    slots, x, ref = Slots(), None, []
    ptrs = set()
    for step in range(300):
        new = _tokens(t=2000 if step == 0 else 1, seed=step)
        x = slots.extend("k", x, new)
        ref.append(new)
        ptrs.add(x.untyped_storage().data_ptr())
    assert torch.equal(x, torch.cat(ref, dim=2))
    # headroom of n/128 slots: about 128 * ln(2299 / 2000) = 18 reallocations in 299 appends
    assert len(ptrs) < 30
    assert x.untyped_storage().nbytes() <= (2299 + headroom(2299)) * 2 * 3 * 8 * 4


def test_extend_never_writes_a_foreign_tensor():
    slots = Slots()
    big = torch.zeros(2, 3, 400, 8)
    view = big[:, :, :300]  # a leading slice of someone else's buffer: looks like it has room
    out = slots.extend("k", view, torch.ones(2, 3, 1, 8))
    assert big.abs().sum() == 0  # untouched
    assert out.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert torch.equal(out[:, :, :300], view) and bool((out[:, :, 300] == 1).all())


def test_grow_matches_cat_in_place_and_never_writes_a_foreign_tensor():
    slots, ref = Slots(), [torch.arange(2 * 3 * 2000, dtype=torch.int32).view(2, 3, 2000)]
    x, kept = slots.grow("pos", None, ref[0]), []
    for step in range(300):
        new = torch.full((2, 3, 1), step, dtype=torch.int32)
        x = slots.grow("pos", x, new)
        ref.append(new)
        kept.append(x)  # alive, so a reallocation cannot reuse a freed address
        if step % 7 == 0:  # an in-place eviction shortens the view: the next step writes in its place
            x, ref = x[..., :-1], [torch.cat(ref, dim=-1)[..., :-1]]
    assert torch.equal(x, torch.cat(ref, dim=-1))
    assert len({t.untyped_storage().data_ptr() for t in kept}) < 30  # in place between reallocations
    big = torch.zeros(2, 3, 400)
    out = slots.grow("pos", big[..., :300], torch.ones(2, 3, 1))  # someone else's buffer, with room
    assert big.abs().sum() == 0 and bool((out[..., 300] == 1).all())
    shared = torch.zeros(2, 1, 50)  # positions shared by the heads of a row: (B, 1, T) grows too
    grown = slots.grow("shared", slots.grow("shared", shared, torch.ones(2, 1, 1)), torch.ones(2, 1, 2))
    assert grown.shape == (2, 1, 53) and float(grown.sum()) == 6.0
    filled = slots.grow("acc", slots.grow("acc", torch.ones(2, 3, 200), 0.0, q=1), 0.0, q=2)  # a value
    assert filled.shape == (2, 3, 203) and float(filled.sum()) == 1200.0 and not bool(filled[..., 200:].any())
    with pytest.raises(TypeError, match="first entries must be a tensor"):
        slots.grow("empty", None, 0.0, q=1)


@pytest.mark.parametrize("heads_shared", [True, False])
def test_take_and_gather_copy_exactly_the_kept_rows(heads_shared):
    x = _tokens()
    g = torch.Generator().manual_seed(1)
    h = 1 if heads_shared else 3
    idx = torch.stack([torch.randperm(300, generator=g)[:200].sort().values for _ in range(2 * h)])
    idx = idx.view(2, h, 200)
    ref = x.gather(2, idx.expand(2, 3, -1)[..., None].expand(-1, -1, -1, 8))
    assert torch.equal(gather_tokens(x, idx), ref)
    slots = Slots()
    grown = slots.extend("k", slots.extend("k", x[:, :, :150].clone(), x[:, :, 150:151]), x[:, :, 151:])
    kept = slots.take("k", grown, idx)  # from a buffer with headroom (non-contiguous view)
    assert torch.equal(kept, ref)
    assert kept.untyped_storage().nbytes() == (200 + headroom(200)) * 2 * 3 * 8 * 4


def test_gather_tokens_falls_back_on_foreign_layouts():
    x = _tokens().transpose(2, 3).contiguous().transpose(2, 3)  # (B, H, T, D) with T-major strides
    idx = torch.arange(0, 300, 3).view(1, 1, -1)
    assert torch.equal(gather_tokens(x, idx, extra=2)[:, :, :100], x[:, :, ::3])


def test_gather_pages_equals_gathering_their_tokens():
    x = _tokens(t=301)
    slots = Slots()
    grown = slots.extend("k", slots.extend("k", x[:, :, :150].clone(), x[:, :, 150:151]), x[:, :, 151:])
    g = torch.Generator().manual_seed(4)
    pages = torch.stack([torch.randperm(18, generator=g)[:5].sort().values for _ in range(6)]).view(2, 3, 5)
    tokens = (pages[..., None] * 16 + torch.arange(16)).flatten(2)  # pages of 16 tokens, the last one at 272
    foreign = x.transpose(2, 3).contiguous().transpose(2, 3)
    for layout in (x, grown, foreign):  # contiguous, a buffer with headroom, token-major strides
        assert torch.equal(gather_pages(layout, pages, 16), gather_tokens(x, tokens))
    assert gather_pages(x, pages[..., :0], 16).shape == (2, 3, 0, 8)


@torch.inference_mode()
def _decode_logits(model, cache, ids, steps=200):
    out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
    logits = [out]
    for _ in range(steps):
        out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
        logits.append(out)
    return torch.cat(logits, dim=1)


def test_long_decode_equals_dynamic_cache():
    """Hundreds of in-place appends past several reallocations give DynamicCache's logits."""
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 260), generator=torch.Generator().manual_seed(0))
    ref = _decode_logits(model, DynamicCache(config=model.config), ids)
    cache = build_cache("full", model)
    got = _decode_logits(model, cache, ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    stored = 260 + 200
    exact = stored * 2 * model.config.num_key_value_heads * 16 * 4 * model.config.num_hidden_layers
    assert exact <= cache.memory_bytes() <= exact * (1 + 1 / 128) + 1  # headroom counted, at most 0.8%


@pytest.mark.parametrize("policy", ["sliding_window", "h2o", "snapkv", "tova"])
def test_in_place_storage_does_not_change_eviction(policy, monkeypatch):
    """Evicting policies give the same logits with generous headroom (in-place appends after every
    eviction) as with none (a fresh buffer every step)."""
    from kvcompress.core import buffers as storage

    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 120), generator=torch.Generator().manual_seed(1))
    params = {
        "budget": 64,
        "compression_ratio": None,
        **({"slack": 2, "evict_at": "always"} if policy == "snapkv" else {}),
    }
    params = {"window": 60} if policy == "sliding_window" else params
    monkeypatch.setattr(storage, "headroom", lambda n: 0)
    ref = _decode_logits(model, build_cache(policy, model, **params), ids, steps=60)
    monkeypatch.setattr(storage, "headroom", lambda n: n // 4)
    moved = []
    drop_one = PolicyLayer.drop_one
    monkeypatch.setattr(
        PolicyLayer, "drop_one", lambda self, slot: moved.append(drop_one(self, slot)) or moved[-1]
    )
    cache = build_cache(policy, model, **params)
    got = _decode_logits(model, cache, ids, steps=60)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # H2O/TOVA reorder keys: summation order
    assert any(moved) == (policy in ("h2o", "tova"))  # their decode evictions really ran in place
    assert all(layer.stored_length() <= 64 + 2 for layer in cache.layers)  # snapkv: budget + slack
