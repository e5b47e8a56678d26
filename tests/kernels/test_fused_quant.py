"""Decode attention straight from quant codes (``kvcompress.kernels.fused_quant``): the same numbers as
attention over
the dequantized copy, the same perplexity, the eager fallback, and a loud failure outside our attention."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_or_skip, make_tiny
from helpers import Compact, Standalone, stream_logits

from kvcompress import build_cache, kernels
from kvcompress.core.executor import Unserved, execute
from kvcompress.core.plan import Call, Kivi, Plan
from kvcompress.kernels import fused_quant
from kvcompress.metrics.compression import attention_backends
from kvcompress.metrics.perplexity import decode_perplexity
from kvcompress.storage.quant import quantizer as Q


def quantized_attention_case(
    bits: int, group: int, te: int = 64, tr: int = 5, d: int = 16, seed: int = 0, key_axis: str = "channel"
):
    """A decode query (1, 6, 1, D) over 2 KV heads: ``te`` quantized tokens then ``tr`` residual ones."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, te + tr, d, generator=g), torch.randn(1, 2, te + tr, d, generator=g)
    keys[..., 3] += 4.0  # an outlier channel, as real keys have
    kq = Q.quantize(keys[:, :, :te], bits, group, key_axis, torch.float16)
    vq = Q.quantize(values[:, :, :te], bits, group, "token", torch.float16)
    query = torch.randn(1, 6, 1, d, generator=g)
    return query, kq, vq, keys[:, :, te:], values[:, :, te:]


def reference(query, kq, vq, k_res, v_res, bits, group):
    """SDPA over the dequantized copy the unfused path builds."""
    te, d = kq.codes.shape[2], k_res.shape[-1]
    k = Q.dequantize(kq, bits, group, "channel", torch.empty(1, 2, te, d))
    v = Q.dequantize(vq, bits, group, "token", torch.empty(1, 2, te, d))
    k, v = torch.cat([k, k_res], 2), torch.cat([v, v_res], 2)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=0.25, enable_gqa=True)
    return out.transpose(1, 2)  # (B, 1, H, D)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("bits,group", [(8, 4), (8, 16), (4, 4), (4, 8), (4, 16), (2, 8), (2, 16)])
@pytest.mark.parametrize("impl", fused_quant.IMPLS)
def test_attention_from_codes_equals_attention_over_the_dequantized_copy(bits, group, impl):
    if impl == "kernel":
        kernel_or_skip("quant_attention")
    query, kq, vq, k_res, v_res = quantized_attention_case(bits, group)
    got = fused_quant.attend(query, kq, vq, k_res, v_res, 0.25, bits, group, impl)
    want = reference(query, kq, vq, k_res, v_res, bits, group)
    assert got.shape == (1, 1, 6, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("bits,group", [(8, 16), (4, 16), (4, 32), (2, 32)])
def test_kernel_vector_path_equals_attention_over_the_dequantized_copy(bits, group):
    """head_dim 64 and groups of 16 or 32 tokens: the kernel's 16-token blocks (AVX-512 where the CPU has
    it; the scalar loops elsewhere give the same numbers)."""
    kernel_or_skip("quant_attention")
    query, kq, vq, k_res, v_res = quantized_attention_case(bits, group, te=96, d=64, seed=1)
    got = fused_quant.attend(query, kq, vq, k_res, v_res, 0.25, bits, group, "kernel")
    want = reference(query, kq, vq, k_res, v_res, bits, group)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _perplexity(model, ids, backend):
    cache = build_cache("quant", model, bits=4, group_size=8, recent=8, backend=backend)
    calls = Compact(cache)
    ppl = decode_perplexity(model, ids, cache, progress=False)["perplexity"]
    if len(calls):  # every compact read ran on the backend asked for
        assert attention_backends(cache)[backend] == len(calls)
    return ppl, len(calls)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_perplexity_is_unchanged_by_the_fused_path(backend):
    if backend == "cpu":
        kernel_or_skip("quant_attention")
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 96), generator=torch.Generator().manual_seed(3))
    dense, dense_calls = _perplexity(model, ids, "dense")
    fused, fused_calls = _perplexity(model, ids, backend)
    assert dense_calls == 0 and fused_calls == 3 * (95 - 16)  # every step once 16 tokens are quantized
    assert abs(fused - dense) <= 1e-4 * dense


@pytest.mark.slow
def test_compiled_path_matches_the_eager_one():
    pytest.importorskip("torch._inductor")
    query, kq, vq, k_res, v_res = quantized_attention_case(4, 8, te=96)
    eager = fused_quant.tensor_attention("eager", query, kq, vq, k_res, v_res, 0.25, 4, 8)
    compiled = fused_quant.tensor_attention("compile", query, kq, vq, k_res, v_res, 0.25, 4, 8)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_auto_falls_back_to_eager_once_compile_fails(monkeypatch):
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no C++ compiler")

        return call

    monkeypatch.setattr(fused_quant, "_COMPILED", {})
    monkeypatch.setattr(fused_quant, "COMPILE_MIN_TOKENS", 0)
    monkeypatch.setattr(torch, "compile", broken)  # as on a machine without a C++ compiler
    args = quantized_attention_case(4, 8)
    with pytest.warns(UserWarning, match="torch.compile unavailable"):
        out = fused_quant.tensor_attention("auto", *args, 0.25, 4, 8)
    torch.testing.assert_close(out, fused_quant.attend(*args, 0.25, 4, 8, "matmul"))
    assert fused_quant._COMPILED["fn"] is None  # not retried
    with pytest.raises(RuntimeError, match="no C"):
        monkeypatch.setattr(fused_quant, "_COMPILED", {})
        fused_quant.tensor_attention("compile", *args, 0.25, 4, 8)


def test_a_deferred_step_outside_kvcompress_attention_fails_loudly(llama, tokens):
    cache = build_cache("quant", llama, bits=4, group_size=4, recent=4, backend="torch")
    llama(tokens[:, :20], cache=cache, use_cache=True)
    llama.set_attn_implementation("sdpa")  # attention that does not read the store
    logits = llama(tokens[:, 20:21], cache=cache, use_cache=True).logits
    assert logits.isnan().all()


def test_unsupported_axes_read_the_dense_copy(llama, tokens):
    cache = build_cache("quant", llama, bits=4, group_size=4, recent=4, value_axis="channel")
    llama(tokens[:, :20], cache=cache, use_cache=True)
    logits = llama(tokens[:, 20:21], cache=cache, use_cache=True).logits
    assert not cache.layers[0].store.attends_codes() and logits.isfinite().all()


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_naming_a_backend_on_a_layout_it_cannot_read_is_refused(llama, backend):
    with pytest.raises(
        ValueError, match=rf"quant.backend='{backend}' reads packed codes of value_axis='token'"
    ):
        build_cache("quant", llama, bits=4, group_size=4, value_axis="channel", backend=backend)
    if backend == "triton":  # its kernel reads KIVI's own key layout only
        with pytest.raises(
            ValueError, match="quant.backend='triton' reads KIVI's layout .key_axis='channel'"
        ):
            build_cache("quant", llama, bits=4, group_size=4, key_axis="token", backend=backend)
    else:  # keys per token: read from their codes (``key_logits_token``)
        build_cache("quant", llama, bits=4, group_size=4, key_axis="token", backend=backend)


def test_the_cpu_backend_without_a_build_is_refused_naming_each_backend(monkeypatch):
    query, kq, vq, k_res, v_res = quantized_attention_case(4, 8)
    monkeypatch.setattr(kernels, "load", lambda *a: None)
    monkeypatch.setattr(kernels, "why", lambda *a: "no compiler")
    plan = Plan(Kivi(kq, vq, k_res, v_res, 4, 8, "cpu"))
    why = "backend 'cpu' asked for.*cpu: the C\\+\\+ kernel quant_attention did not build: no compiler.*torch"
    with pytest.raises(Unserved, match=why):
        execute(plan, Call(Standalone(), query, 0.25, {}, "sdpa"))
    # auto without the kernel reads the dense copy on a CPU (the tensor forms are slower there)
    llama = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = build_cache("quant", llama, bits=4, group_size=4, recent=4)
    for t in range(ids.shape[1]):
        llama(ids[:, t : t + 1], cache=cache, use_cache=True)
    assert all(layer.store.attends_codes() for layer in cache.layers)  # it offered its codes
    assert not Compact(cache) and all(set(layer.backends_ran) == {"sdpa"} for layer in cache.layers)


def _reads(cache) -> dict[str, int]:
    """Layer-steps per read form (each layer's ``attention_reads`` in ``cache.stats()``), summed."""
    total = {}
    for layer in cache.stats():
        for form, n in layer["attention_reads"].items():
            total[form] = total.get(form, 0) + n
    return total


def test_the_cpu_backend_reads_the_codes_where_the_kernel_builds(llama, tokens):
    kernel_or_skip("quant_attention")
    cache = build_cache("quant", llama, bits=4, group_size=4, recent=4, backend="cpu")
    stream_logits(llama, tokens[:, :24], cache, chunk=1)
    ran, reads = attention_backends(cache), _reads(cache)
    assert set(ran) == {"cpu", "sdpa"} and ran["cpu"] == reads["kivi"] > 0  # the first steps: nothing coded
    assert ran["sdpa"] == reads["dense"]


def test_the_cpu_backend_is_refused_by_name_where_the_kernel_is_not_served(llama, tokens, monkeypatch):
    """No dense copy instead, as the C++ kernel asked for by name always was; ``auto`` reads dense there."""
    monkeypatch.setattr(kernels, "load", lambda *a: None)
    monkeypatch.setattr(kernels, "why", lambda *a: "no compiler")
    cache = build_cache("quant", llama, bits=4, group_size=4, recent=4, backend="cpu")
    why = r"kivi read \(backend 'cpu' asked for, on cpu.*cpu: the C\+\+ kernel quant_attention did not build"
    with pytest.raises(Unserved, match=why):
        stream_logits(llama, tokens[:, :24], cache, chunk=1)


def test_the_dense_backend_reads_a_dequantized_copy_for_the_models_attention(llama, tokens):
    cache = build_cache("quant", llama, bits=4, group_size=4, recent=4, backend="dense")
    stream_logits(llama, tokens[:, :24], cache, chunk=1)
    assert _reads(cache) == {"dense": 24 * len(cache.layers)}
    assert attention_backends(cache) == {"sdpa": 24 * len(cache.layers)}
    assert not any(layer.store.attends_codes() for layer in cache.layers)


def test_the_triton_backend_by_name_reads_the_codes_where_it_serves_them_and_refuses_elsewhere(llama, tokens):
    """On a CPU the Triton kernels serve only under the interpreter (``on_cpu``): there they read every
    coded step; outside it the step is refused by name, never read dense instead."""
    pytest.importorskip("triton")
    from kvcompress.kernels import triton_backend

    with triton_backend.on_cpu():
        cache = build_cache("quant", llama, bits=4, group_size=4, recent=4, backend="triton")
        stream_logits(llama, tokens[:, :16], cache, chunk=1)
    ran, reads = attention_backends(cache), _reads(cache)
    assert set(ran) == {"triton", "sdpa"} and ran["triton"] == reads["kivi"] > 0
    cache = build_cache("quant", llama, bits=4, group_size=4, recent=4, backend="triton")
    with pytest.raises(Unserved, match=r"backend 'triton' asked for.*triton: CUDA tensors only"):
        stream_logits(llama, tokens[:, :16], cache, chunk=1)
