"""KVzip's reconstruction scores: the blocked max of ``logit - lse`` equals the most softmax attention any
query of a group gives each stored key (a float64 reference), with padding keys and padding queries, from an
``lse`` handed over by the attention or computed in place; SDPA's flash kernel gives that ``lse`` beside the
very output the ``sdpa`` backend returns; a context pass scores the same either way."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcompress import build_cache, compress_context
from kvcompress.core import kernel_slots
from kvcompress.core.masks import causal
from kvcompress.core.plan import Call
from kvcompress.kernels import flash_lse
from kvcompress.selectors.eviction import kvzip_scores
from kvcompress.selectors.eviction.kvzip import KVzipLayer
from kvcompress.selectors.eviction.kvzip_scores import max_attention

B, H, H_KV, Q, STORED, D = 2, 6, 2, 7, 20, 8


def _inputs(seed: int = 0):
    """Queries (B, H, Q, D), keys (B, H_KV, STORED + Q, D), key validity (row 1: three left-padding keys,
    and its last two chunk tokens are padding) and query validity."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H, Q, D, generator=gen) * 2
    key = torch.randn(B, H_KV, STORED + Q, D, generator=gen)
    query_valid = torch.ones(B, Q, dtype=torch.bool)
    query_valid[1, -2:] = False
    key_valid = torch.ones(B, 1, STORED + Q, dtype=torch.bool)
    key_valid[1, 0, :3] = False
    key_valid[:, 0, STORED:] = query_valid
    return query, key, key_valid, query_valid


def _reference(query, key, scaling, key_valid, query_valid):
    """Float64 softmax of every query over the keys it may read; the max over each group's queries and
    heads of the probabilities of the stored keys (B, H_KV, STORED), padding queries giving nothing; and
    each query's log-sum-exp (B, H, Q)."""
    rep = key.double().repeat_interleave(H // H_KV, dim=1)  # (B, H, T, D)
    logits = torch.matmul(query.double(), rep.mT) * scaling  # (B, H, Q, T)
    allowed = causal(Q, STORED + Q) & key_valid[:, :, None, :]  # (B, 1, Q, T)
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., :STORED] * query_valid[:, None, :, None]
    top = probs.reshape(B, H_KV, H // H_KV * Q, STORED).amax(dim=2)
    return top, logits.logsumexp(dim=-1)


@pytest.mark.parametrize("lse_from", ["attention", "computed"])
@pytest.mark.parametrize("block", [3, 256])
def test_max_attention_equals_a_float64_reference_with_padding(lse_from, block, monkeypatch):
    monkeypatch.setattr(kvzip_scores, "QUERY_BLOCK", block)  # blocks that split a group's queries, or one
    query, key, key_valid, query_valid = _inputs()
    ref, lse = _reference(query, key, 0.3, key_valid, query_valid)
    lse = lse.float() if lse_from == "attention" else None
    got = max_attention(query, key, 0.3, STORED, key_valid, query_valid, lse=lse)
    assert got.dtype == torch.float32 and got.shape == (B, H_KV, STORED)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
    assert bool((got[1, :, :3] == 0).all())  # padding keys get nothing


def test_flash_kernel_gives_the_sdpa_backends_output_and_each_querys_lse():
    model = make_tiny("llama")
    module = model.model.layers[0].self_attn
    h, h_kv, d = module.config.num_attention_heads, module.config.num_key_value_heads, module.head_dim
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(B, h, Q, d, generator=gen)
    key, value = (torch.randn(B, h_kv, STORED + Q, d, generator=gen) for _ in range(2))
    _, _, key_valid, _ = _inputs()
    mask = causal(Q, STORED + Q) & key_valid[:, :, None, :]  # (B, 1, Q, T)
    call = Call(module, query, module.scaling, {}, "sdpa")
    with torch.inference_mode():
        out, lse = flash_lse.attention_with_lse(call, key, value, mask)
        sdpa, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    assert torch.equal(out, sdpa)
    logits = torch.matmul(query.double(), key.double().repeat_interleave(h // h_kv, 1).mT) * module.scaling
    ref = logits.masked_fill(~mask, float("-inf")).logsumexp(dim=-1)
    torch.testing.assert_close(lse.double(), ref, rtol=1e-5, atol=1e-5)
    one = Call(module, query[:, :, :1], module.scaling, {}, "sdpa")
    assert flash_lse.attention_with_lse(one, key, value, mask[:, :, :1]) is None  # a decode query: SDPA's own


def _pass_scores(model, ids, mask, probs: str, monkeypatch):
    """Each layer's scores when its context pass ends, and what it keeps, with ``observed_probs = probs``;
    how often the attention handed over its lse."""
    cache = build_cache("kvzip", model, compression_ratio=0.5, context_chunk=16)
    model(ids, attention_mask=mask, cache=cache)
    found, used = [], []
    end, attention_with_lse = KVzipLayer.end_pass, flash_lse.attention_with_lse

    def ending(self, *args, **kwargs):
        found.append(self.pass_scores.clone())
        end(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(KVzipLayer, "observed_probs", probs)
        m.setattr(KVzipLayer, "end_pass", ending)
        spy = [lambda *a: used.append(1) or attention_with_lse(*a)]  # the executor's SDPA asks this slot
        m.setitem(kernel_slots._LENT, "sdpa_lse", spy)
        compress_context(model, cache, ids, attention_mask=mask)
    return found, [layer.keys for layer in cache.layers], len(used)


@torch.inference_mode()
def test_context_pass_scores_the_same_from_the_attentions_lse_or_its_own(monkeypatch):
    model = make_tiny("llama")
    ids = torch.randint(2, 95, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a left-padded row: padding keys, and its last chunk ends in padding queries
    fast, kept, used = _pass_scores(model, ids, mask, "lse", monkeypatch)
    own, kept_own, _ = _pass_scores(model, ids, mask, "last", monkeypatch)  # SDPA returns no lse then
    assert used > 0, "the context pass never took the attention's lse"
    assert len(fast) == len(own) == len(model.model.layers)
    for a, b in zip(fast, own, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_own, strict=True))
