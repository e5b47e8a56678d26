"""Head-adaptive budgets (``adaptive: true``, Ada-KV): heads keep different numbers of tokens, those are the
only ones stored (bytes counted exactly), and attention is exact over each head's own tokens."""

from __future__ import annotations

import pytest
import torch

from kvcompress import build_cache
from kvcompress.selectors.eviction import adaptive as ada

G = torch.Generator().manual_seed(5)
IDS = torch.randint(2, 95, (1, 48), generator=G)
STEPS = torch.randint(2, 95, (1, 5), generator=G)
SNAP = dict(compression_ratio=0.5, observation_window=8)


def _kept_pairs(monkeypatch) -> list[torch.Tensor]:
    """Record every allocation (pair indices per layer, in layer order)."""
    seen, allocate = [], ada.allocate

    def recorded(*args):
        pairs = allocate(*args)
        seen.append(pairs)
        return pairs

    monkeypatch.setattr(ada, "allocate", recorded)
    return seen


@torch.inference_mode()
def _decode(model, cache) -> torch.Tensor:
    return torch.cat([model(STEPS[:, i : i + 1], cache=cache).logits for i in range(STEPS.shape[1])], 1)


@pytest.mark.parametrize("name", ["snapkv", "expected_attention", "kvzip"])
def test_each_head_attends_exactly_over_its_own_tokens(name, llama, monkeypatch):
    """The reference is a cache holding every token with each head masked to the pairs the adaptive cache
    kept: the next steps' logits agree."""
    pairs = _kept_pairs(monkeypatch)
    params = {
        "compression_ratio": 0.5,
        "adaptive": True,
        **({"observation_window": 8} if name == "snapkv" else {}),
    }
    cache = build_cache(name, llama, **params)
    with torch.inference_mode():
        llama(IDS, cache=cache)
    if name == "kvzip":
        from kvcompress import compress_context

        compress_context(llama, cache, IDS)
    assert len(pairs) == len(cache.layers)
    reference = build_cache("full", llama)
    with torch.inference_mode():
        llama(IDS, cache=reference)
    h, t = llama.config.num_key_value_heads, IDS.shape[1]
    for layer, kept in zip(reference.layers, pairs, strict=True):
        member = torch.zeros(1, t * h, dtype=torch.bool)
        member[0, kept[0]] = True
        layer.valid = member.view(1, t, h).transpose(1, 2).contiguous()  # (1, H_kv, T): head h keeps token t
    torch.testing.assert_close(_decode(llama, cache), _decode(llama, reference), atol=1e-5, rtol=1e-5)


def test_heads_keep_different_counts_and_only_those_are_stored(llama, monkeypatch):
    pairs = _kept_pairs(monkeypatch)
    cache = build_cache("snapkv", llama, adaptive=True, **SNAP)
    uniform = build_cache("snapkv", llama, **SNAP)
    with torch.inference_mode():
        llama(IDS, cache=cache)
        llama(IDS, cache=uniform)
    h, d = llama.config.num_key_value_heads, llama.config.hidden_size // llama.config.num_attention_heads
    k = uniform.layers[0].stored_length()
    counts = [s["tokens_per_head"] for s in cache.stats()]
    assert all(sum(c) == h * k for c in counts)  # the layer's budget, shared
    assert any(len(set(c)) > 1 for c in counts)  # and shared unevenly
    assert all(min(c) >= 0.2 * k for c in counts)  # the safeguard
    # keys and values of the kept pairs in float32, and one int8 head id per pair: nothing else
    assert cache.memory_bytes() == sum(p.shape[-1] * (2 * d * 4 + 1) for p in pairs)
    assert cache.memory_bytes() == uniform.memory_bytes() + sum(p.shape[-1] for p in pairs)
    for c, layer in zip(counts, cache.layers, strict=True):
        assert torch.bincount(layer.head_of[0, 0].long(), minlength=h).tolist() == c


def test_allocation_is_one_ranking_of_pairs_after_the_safeguard():
    prio = torch.tensor([[[9.0, 8.0, 7.0, 6.0], [1.0, 0.5, 0.2, 0.1]]])  # (1, 2 heads, 4 tokens)
    got = ada.allocate(prio, 2, 0.5)  # 4 pairs; each head keeps its best 1 first
    assert sorted((int(p) % 2, int(p) // 2) for p in got[0]) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert ada.allocate(prio, 2, 0.0)[0].tolist() == [0, 2, 4, 6]  # head 0 takes all: pairs t * 2 + 0


def test_adaptive_is_refused_where_it_cannot_act(llama):
    with pytest.raises(ValueError, match="snapkv evicts at every decode step from more than its query"):
        build_cache(
            "snapkv", llama, adaptive=True, slack=8, evict_at="always"
        )  # re-compresses over a window of past queries
    with pytest.raises(ValueError, match="storage=dense"):
        build_cache("snapkv", llama, adaptive=True, storage="quant")
    padded = build_cache("snapkv", llama, adaptive=True, **SNAP)
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="padded rows"), torch.inference_mode():
        llama(IDS, attention_mask=mask, cache=padded)
    cache = build_cache("snapkv", llama, adaptive=True, **SNAP)
    with torch.inference_mode():
        llama(IDS, cache=cache)
        with pytest.raises(ValueError, match="several tokens"):
            llama(IDS[:, :20], cache=cache)  # a later step of several tokens over the budget
    with pytest.raises(ValueError, match="adaptive"):
        cache.crop(-1)


def test_a_saved_adaptive_cache_loads_and_continues_the_same(llama, tmp_path):
    from kvcompress import load_cache, save_cache

    cache = build_cache("snapkv", llama, adaptive=True, **SNAP)
    with torch.inference_mode():
        llama(IDS, cache=cache)
    save_cache(cache, tmp_path / "c.kvc")
    loaded = load_cache(tmp_path / "c.kvc", llama)
    assert loaded.memory_bytes() == cache.memory_bytes()
    torch.testing.assert_close(_decode(llama, loaded), _decode(llama, cache), atol=0, rtol=0)


def _masked_reference(model, cache):
    """A ``full`` cache holding, per KV head, exactly the pairs ``cache`` holds flat (each head's in its
    stored order, padded to the longest head and masked): what exact attention per head reads."""
    ref = build_cache("full", model)
    with torch.inference_mode():
        model(IDS[:, :1], cache=ref)
    h = model.config.num_key_value_heads
    for layer, out in zip(cache.layers, ref.layers, strict=True):
        keys, values = layer.store.read()  # (1, 1, N, D)
        heads = layer.head_of[0, 0].long()
        m = int(torch.bincount(heads, minlength=h).max())
        k = torch.zeros(1, h, m, keys.shape[-1])
        v, valid = torch.zeros_like(k), torch.zeros(1, h, m, dtype=torch.bool)
        for hd in range(h):
            own = (heads == hd).nonzero()[:, 0]
            k[0, hd, : len(own)], v[0, hd, : len(own)], valid[0, hd, : len(own)] = (
                keys[0, 0, own],
                values[0, 0, own],
                True,
            )
        out.store.keys, out.store.values, out.valid, out.seen = k, v, valid, layer.seen
    return ref


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_decode_time_selectors_keep_evicting_pairs_exactly(name, llama):
    """h2o and tova go on evicting pairs across heads at every decode step; the layer's budget holds at
    every step, and a step's logits equal those of a cache holding each head's own pairs, masked."""
    cache = build_cache(name, llama, compression_ratio=0.5, adaptive=True)
    with torch.inference_mode():
        llama(IDS, cache=cache)
        for step in range(STEPS.shape[1] - 1):
            llama(STEPS[:, step : step + 1], cache=cache)
    h, seen = llama.config.num_key_value_heads, cache.get_seq_length()
    counts = [s["tokens_per_head"] for s in cache.stats()]
    assert all(sum(c) == h * (seen // 2) for c in counts) and any(len(set(c)) > 1 for c in counts)
    assert all(s["tokens_evicted"] == seen - seen // 2 for s in cache.stats())
    reference = _masked_reference(llama, cache)
    with torch.inference_mode():
        want, got = llama(STEPS[:, -1:], cache=reference).logits, llama(STEPS[:, -1:], cache=cache).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
