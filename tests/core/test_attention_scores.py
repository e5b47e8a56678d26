"""Scores from our attention function equal eager attention probabilities, without eager attention."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from kvcompress import build_cache
from kvcompress.core.torch_attention import window_scores


def _grouped(probs: torch.Tensor, num_kv: int) -> torch.Tensor:
    """Eager probabilities (B, H, q, T) averaged over each KV group's query heads: (B, H_kv, q, T)."""
    b, h, q, t = probs.shape
    return probs.reshape(b, num_kv, h // num_kv, q, t).mean(2)


def _capture(model, chunks, attention_mask=None, window=None):
    """Run ``chunks`` through a full cache whose layers record ``window_scores`` of every step."""
    cache = build_cache("full", model)
    seen = {i: [] for i in range(len(cache.layers))}
    for layer in cache.layers:

        def observe(query, key, scaling, probs=None, _layer=layer):
            w = query.shape[2] if window is None else window
            seen[_layer.layer_idx].append(window_scores(query[:, :, -w:], key, scaling, _layer.valid))

        layer.wants_scores, layer.observe_attention = True, observe
    done = 0
    with torch.inference_mode():
        for ids in chunks:
            done += ids.shape[1]
            mask = None if attention_mask is None else attention_mask[:, :done]
            model(ids, attention_mask=mask, cache=cache, use_cache=True)
    return seen


def _eager_probs(family, ids, attention_mask=None):
    model = make_tiny(family, attn="eager")
    with torch.inference_mode():
        return model(ids, attention_mask=attention_mask, output_attentions=True).attentions


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_scores_equal_eager_probabilities_over_chunks_and_decode(family, tokens):
    model = make_tiny(family)  # sdpa underneath: the policy never needs eager attention
    assert model.config._attn_implementation == "sdpa"
    chunks = [tokens[:, :20], tokens[:, 20:47], tokens[:, 47:]]  # prefill, chunked prefill, one decode step
    seen = _capture(model, chunks)
    eager = _eager_probs(family, tokens)
    num_kv = model.config.num_key_value_heads
    for layer_idx, probs in enumerate(eager):
        ref = _grouped(probs.float(), num_kv)  # (1, H_kv, 48, 48)
        for got, (lo, hi) in zip(seen[layer_idx], [(0, 20), (20, 47), (47, 48)], strict=True):
            assert got.dtype == torch.float32 and got.shape == (1, num_kv, hi - lo, hi)
            torch.testing.assert_close(got, ref[:, :, lo:hi, :hi], atol=1e-4, rtol=0)


def test_window_is_the_last_queries_only(llama, tokens):
    seen = _capture(llama, [tokens], window=5)
    ref = _grouped(_eager_probs("llama", tokens)[1].float(), 2)
    assert seen[1][0].shape == (1, 2, 5, 48)  # O(window x T), never T x T
    torch.testing.assert_close(seen[1][0], ref[:, :, -5:], atol=1e-4, rtol=0)


def test_padding_keys_get_zero_and_real_rows_match_eager(llama):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 95, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    seen = _capture(llama, [ids[:, :16], ids[:, 16:]], attention_mask=mask)
    got = seen[0][1]  # layer 0, second chunk: (2, H_kv, 8, 24)
    assert torch.all(got[1, :, :, :6] == 0)
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)), atol=1e-5, rtol=0)
    ref = _grouped(_eager_probs("llama", ids[1:, 6:])[0].float(), 2)  # row 1 without its padding
    torch.testing.assert_close(got[1:, :, :, 6:], ref[:, :, -8:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scores_accumulate_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 16, generator=g)
    key = torch.randn(1, 2, 40, 16, generator=g)
    ref = window_scores(query, key, 0.25)
    got = window_scores(query.to(dtype), key.to(dtype), 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.sum(-1), torch.ones(1, 2, 3), atol=1e-6, rtol=0)
    # the same rounded inputs in float32: equal up to float32 rounding (scores ~0.025, up to 0.19); a half
    # precision matmul or softmax would be off by ~1e-4 (fp16) to ~1e-3 (bf16)
    exact = window_scores(query.to(dtype).float(), key.to(dtype).float(), 0.25)
    torch.testing.assert_close(got, exact, atol=1e-7, rtol=1e-6)
    # the unrounded inputs: probabilities move by about the inputs' rounding, relatively
    torch.testing.assert_close(got, ref, atol=0, rtol=2 * torch.finfo(dtype).eps)
    causal = got[0, :, 0, 38:]  # the first window query sits at position 37: later keys get nothing
    assert torch.all(causal == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_attention_matches_sdpa_and_window_scores(dtype):
    """One query per row: the fused path's output equals SDPA's and its probabilities equal a separate
    ``window_scores`` pass, so H2O/TOVA/block_evict read the same scores without the second pass."""
    from kvcompress.core.torch_attention import decode_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 1, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, 40, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, 40, 16, generator=g).to(dtype)
    out, probs = decode_attention(q, k, v, 0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(3, 1), v.float().repeat_interleave(3, 1), scale=0.25
    ).transpose(1, 2)  # (B, 1, H, D)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(probs, window_scores(q, k, 0.25), rtol=1e-5, atol=1e-6)
    assert out.dtype == dtype and probs.shape == (2, 2, 1, 40)
    alone, none = decode_attention(q, k, v, 0.25, scores=False)  # a layer that attends grouped, no scores
    assert none is None and torch.equal(alone, out)


def test_fused_decode_path_only_for_plain_softmax_attention():
    """Soft-capping, learned sinks (``s_aux``) or training fall back to the model's own kernel: the grouped
    ``torch`` backend declines such a call and names why."""
    from types import SimpleNamespace

    from kvcompress.core.plan import Call, Dense, Plan
    from kvcompress.kernels.backends import Torch

    def call(training=False, cap=None, **kwargs):
        module = SimpleNamespace(training=training, config=SimpleNamespace(attn_logit_softcapping=cap))
        plain = not training and cap is None and kwargs.get("s_aux") is None  # the attention hook's rule
        return Call(module, torch.randn(1, 4, 1, 8), 0.3, kwargs, "sdpa", plain=plain)

    key = torch.randn(1, 2, 5, 8)
    plan = Plan(Dense(key, key, None), probs="last")
    assert Torch().missing(plan, call()) is None
    for refused in (call(s_aux=torch.zeros(4)), call(cap=30.0), call(training=True)):
        assert (
            Torch().missing(plan, refused)
            == "plain softmax only (the model adds soft-capping, sinks or dropout)"
        )
