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
    with pytest.raises(ValueError, match="h2o evicts at every decode step"):
        build_cache("h2o", llama, adaptive=True)
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
        with pytest.raises(ValueError, match="second eviction"):
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
