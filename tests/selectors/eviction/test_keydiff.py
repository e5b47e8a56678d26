"""KeyDiff against a float64 reference: the kept keys are the ones least similar to the mean unit key, and
the step asks attention for no probabilities (the model's own backend serves it)."""

from __future__ import annotations

import torch
from helpers import stream_logits

from kvcompress.core.cache import build_cache
from kvcompress.core.policy import ModelSpec
from kvcompress.selectors.eviction.keydiff import KeyDiffPolicy, keydiff_scores

D = 8
SPEC = ModelSpec(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=D, max_positions=128)


def reference_order(keys: torch.Tensor) -> torch.Tensor:
    """Float64 KeyDiff ranking of keys (B, H, T, D): indices by ascending cosine to the mean unit key."""
    k = keys.double()
    unit = k / k.norm(dim=-1, keepdim=True)
    anchor = unit.mean(-2, keepdim=True)
    cos = (unit * anchor).sum(-1) / anchor.norm(dim=-1)
    return cos.argsort(dim=-1)  # (B, H, T): most distinctive first


def ids_of(stored: torch.Tensor, keys: torch.Tensor) -> list:
    """Which of ``keys`` (B, H, T, D) each stored key (B, H, k, D) is, sorted per row and head."""
    same = (stored[:, :, :, None, :] == keys[:, :, None, :, :]).all(-1)  # (B, H, k, T)
    assert bool((same.sum(-1) == 1).all()), "every stored key is exactly one of the keys appended"
    return same.float().argmax(-1).sort(dim=-1).values.tolist()


def test_scores_match_the_float64_cosine_to_the_mean_unit_key():
    keys = torch.randn(2, 3, 17, D, generator=torch.Generator().manual_seed(0))
    k = keys.double()
    unit = k / k.norm(dim=-1, keepdim=True)
    anchor = unit.mean(-2, keepdim=True)
    want = -(unit * anchor).sum(-1) / anchor.norm(dim=-1)
    torch.testing.assert_close(keydiff_scores(keys, None).double(), want, atol=1e-6, rtol=0)
    valid = torch.ones(2, 1, 17, dtype=torch.bool)
    valid[0, 0, :5] = False  # row 0's first five slots are padding: its anchor is its own last 12 keys
    got = keydiff_scores(keys, valid)[0, :, 5:].double()
    torch.testing.assert_close(got, keydiff_scores(keys[:1, :, 5:], None)[0].double(), atol=1e-6, rtol=0)


def test_prefill_and_each_decode_step_keep_the_budget_the_reference_ranks_first():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 30, D, generator=g)
    layer = KeyDiffPolicy(budget=12, compression_ratio=None).layer(0, SPEC)
    out, _ = layer.update(keys[:, :, :20], keys[:, :, :20] * 2)
    layer.observe_attention(torch.randn(1, 2, 20, D), out, 1.0)
    want = reference_order(keys[:, :, :20])[..., :12]  # the 12 least similar of the prompt's 20
    assert ids_of(layer.keys, keys) == want.sort(dim=-1).values.tolist()
    for t in range(20, 30):  # one token in, the most similar of the 13 out, in place
        before = layer.keys.clone()
        out, _ = layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1] * 2)
        layer.observe_attention(torch.randn(1, 2, 1, D), out, 1.0)
        held = torch.cat([before, keys[:, :, t : t + 1]], dim=2)  # (1, 2, 13, D)
        drop = reference_order(held)[..., -1:]  # the most similar key of each head
        kept = torch.stack([held[0, h][torch.arange(13) != drop[0, h, 0]] for h in range(2)])[None]
        assert ids_of(layer.keys, keys) == ids_of(kept, keys)
        assert torch.equal(layer.values.sort(dim=2).values, (layer.keys * 2).sort(dim=2).values)
    assert layer.stored_length() == 12 and layer.evicted == 30 - 12


def test_no_probabilities_are_asked_so_the_models_own_attention_serves_every_step(llama):
    ids = torch.randint(2, 95, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = build_cache("keydiff", llama, budget=12, compression_ratio=None)
    stream_logits(llama, ids[:, :32], cache, chunk=32)
    stream_logits(llama, ids[:, 32:], cache, chunk=1)  # eight decode steps
    h2o = build_cache("h2o", llama, budget=12, compression_ratio=None)
    stream_logits(llama, ids[:, :32], h2o, chunk=32)
    stream_logits(llama, ids[:, 32:], h2o, chunk=1)
    for layer, scored in zip(cache.layers, h2o.layers, strict=True):
        assert layer.stored_length() == 12 and layer.evicted == 40 - 12
        assert layer.stats()["attention_backends"] == {"sdpa": 9}  # the model's own kernel, every step
        assert scored.stats()["attention_backends"].get("sdpa") == 1  # h2o's decode scores: another backend
