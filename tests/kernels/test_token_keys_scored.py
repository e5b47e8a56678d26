"""Decode attention from per-token key codes, with the probabilities score-based eviction reads
(``fused_quant.attend_scored``, the C++ ``key_logits_token``): H2O and TOVA over ``key_axis=token`` quant
read their codes instead of a dequantized copy of the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_or_skip, make_tiny
from test_fused_quant import quantized_attention_case

from kvcompress import build_cache
from kvcompress.kernels import fused_quant
from kvcompress.metrics.compression import attention_backends
from kvcompress.storage.quant import quantizer as Q


def _reference(query, kq, vq, k_res, v_res, bits, group):
    """Output (B, 1, H, D) and group-mean probabilities (B, H_kv, 1, T) over the dequantized copy, float64."""
    te, d = kq.codes.shape[2], k_res.shape[-1]
    k = Q.dequantize(kq, bits, group, "token", torch.empty(1, 2, te, d))
    v = Q.dequantize(vq, bits, group, "token", torch.empty(1, 2, te, d))
    k, v = torch.cat([k, k_res], 2).double(), torch.cat([v, v_res], 2).double()
    q = query.double().view(1, 2, 3, d)  # (B, H_kv, g, D)
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1)  # (B, H_kv, g, T)
    return (p @ v).reshape(1, 1, 6, d), p.mean(2, keepdim=True)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("bits,group", [(8, 8), (4, 8), (4, 16), (2, 16), (4, 32)])
@pytest.mark.parametrize("impl", ["matmul", "kernel"])
def test_scored_attention_from_token_key_codes_equals_the_dequantized_copy(bits, group, impl):
    if impl == "kernel":
        kernel_or_skip("quant_attention")
    case = quantized_attention_case(bits, group, te=40, d=32, key_axis="token")
    out, probs = fused_quant.attend_scored(*case[:5], 0.25, bits, group, impl, "token", True)
    want_out, want_probs = _reference(*case, bits, group)
    assert out.shape == (1, 1, 6, 32) and probs.shape == (1, 2, 1, 45) and probs.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.double(), want_probs, rtol=1e-5, atol=1e-6)
    assert fused_quant.attend_scored(*case[:5], 0.25, bits, group, impl, "token")[1] is None


@pytest.mark.parametrize("policy", ["h2o", "tova"])
@torch.inference_mode()
def test_h2o_and_tova_over_token_quant_read_the_codes_and_score_as_the_dense_read(policy):
    """Each decode step reads KIVI codes (``attention_reads``), and the model's logits match the same policy
    reading a dequantized copy (``backend=dense``) to float rounding."""
    kernel_or_skip("quant_attention")
    model = make_tiny("llama")
    storage = {"name": "quant", "bits": 4, "group_size": 8, "recent": 8, "key_axis": "token"}
    params = {"budget": 24, "compression_ratio": None}
    prompt = torch.randint(2, 95, (1, 40), generator=torch.Generator().manual_seed(4))
    logits = {}
    for backend in ("auto", "dense"):
        cache = build_cache(policy, model, **params, storage={**storage, "backend": backend})
        model(prompt, cache=cache, use_cache=True)
        steps = [model(torch.tensor([[5 + i]]), cache=cache, use_cache=True).logits[0, -1] for i in range(8)]
        logits[backend] = torch.stack(steps)
        kivi = sum(layer["attention_reads"].get("kivi", 0) for layer in cache.stats())
        assert all(layer["tokens_stored"] == 24 for layer in cache.stats())
        steps = 8 * len(cache.layers)  # the decode layer-steps (the prompt's forward reads dense)
        if backend == "auto":
            assert kivi == steps and attention_backends(cache).get("cpu") == steps
        else:
            assert kivi == 0
    torch.testing.assert_close(logits["auto"], logits["dense"], rtol=1e-4, atol=1e-4)
