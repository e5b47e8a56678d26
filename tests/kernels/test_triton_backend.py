"""The ``triton`` backend inside whole models: on a CPU under Triton's interpreter (``on_cpu``), each read
form it declares runs through its kernels at every decode layer-step, and the logits equal those of the
CPU backends (the C++ kernels, the grouped torch form, SDPA) to float rounding."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import Standalone

pytest.importorskip("triton")

from kvcompress import build_cache  # noqa: E402
from kvcompress.core.plan import Call, Dense, Plan  # noqa: E402
from kvcompress.kernels import triton_backend  # noqa: E402
from kvcompress.metrics.compression import attention_backends  # noqa: E402

PREFILL, STEPS = 24, 6
CASES = {  # policy, its parameters, the read the decode steps make
    "h2o": ({"budget": 16, "recent": 4}, "dense"),
    "quant": ({"bits": 4, "group_size": 8, "recent": 4}, "kivi"),
    "block_sparse": ({"block_size": 4, "top_k_blocks": 3}, "pages"),
}


def _run(model, cache, ids, mask=None) -> torch.Tensor:
    """Prefill ``ids[:, :PREFILL]`` in one forward, then one token per step: the logits of every step."""
    out = []
    with torch.inference_mode():
        am = None if mask is None else mask[:, :PREFILL]
        out.append(model(ids[:, :PREFILL], attention_mask=am, cache=cache).logits[:, -1])
        for t in range(PREFILL, ids.shape[1]):
            am = None if mask is None else mask[:, : t + 1]
            out.append(model(ids[:, t : t + 1], attention_mask=am, cache=cache).logits[:, -1])
    return torch.stack(out, 1)


def _cache(name, model):
    return build_cache(name, model, **CASES[name][0])


@pytest.mark.parametrize("name", ["h2o", "quant", "block_sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_read_form_runs_through_the_kernels_with_the_same_logits(name, dtype):
    model = make_tiny("llama", dtype=dtype)
    ids = torch.randint(2, 90, (1, PREFILL + STEPS), generator=torch.Generator().manual_seed(5))
    base = _cache(name, model)
    want = _run(model, base, ids)
    with triton_backend.on_cpu():
        cache = _cache(name, model)
        got = _run(model, cache, ids)
    ran = attention_backends(cache)
    assert ran.get("triton") == STEPS * len(cache.layers), ran  # every decode layer-step, prefill elsewhere
    assert "triton" not in attention_backends(base)
    reads = sum(layer.reads_ran.get(CASES[name][1], 0) for layer in cache.layers)
    assert reads >= STEPS * len(cache.layers), reads
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_left_padded_batch_attends_only_real_keys():
    """h2o over a left-padded batch of 2: the masked, scored read; each row's logits equal its own run."""
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (2, PREFILL + STEPS), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with triton_backend.on_cpu():
        cache = build_cache("h2o", model, budget=16, recent=4)
        got = _run(model, cache, ids, mask)
    base = build_cache("h2o", model, budget=16, recent=4)
    want = _run(model, base, ids, mask)
    assert attention_backends(cache).get("triton") == STEPS * len(cache.layers)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_backend_declares_what_it_does_not_serve():
    """Off the interpreter's scope a CPU plan is not served, and plain dense reads are left to the model's
    own kernel; each with its reason."""
    backend = triton_backend.Triton()
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    call = Call(Standalone(), q, 0.25, {}, "sdpa")
    assert "CUDA tensors only" in backend.missing(Plan(Dense(k, k, None), "last"), call)
    with triton_backend.on_cpu():
        assert backend.missing(Plan(Dense(k, k, None), "last"), call) is None
        assert "plain ones" in backend.missing(Plan(Dense(k, k, None)), call)
        three_heads = torch.ones(1, 3, 1, 5, dtype=torch.bool)
        assert "not a key mask per KV head" in backend.missing(Plan(Dense(k, k, three_heads), "last"), call)
        prefill = Call(Standalone(), torch.randn(1, 4, 3, 16), 0.25, {}, "sdpa")
        assert "one decode query" in backend.missing(Plan(Dense(k, k, None), "last"), prefill)


def test_prefill_score_windows_come_from_the_kernel_with_the_same_selection():
    """SnapKV ranks the prompt by its observation window's probabilities: under ``on_cpu`` they come from the
    Triton window kernel (counted by a spy), and the cache keeps the same tokens with the same logits."""
    from kvcompress.core import torch_attention

    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, PREFILL + STEPS), generator=torch.Generator().manual_seed(7))
    calls = []
    (kernel,) = torch_attention.WINDOW_SCORERS

    def spy(*args):
        out = kernel(*args)
        calls.append(out is not None)
        return out

    base = build_cache("snapkv", model, budget=16, observation_window=4)
    want = _run(model, base, ids)
    torch_attention.WINDOW_SCORERS[:] = [spy]
    try:
        with triton_backend.on_cpu():
            cache = build_cache("snapkv", model, budget=16, observation_window=4)
            got = _run(model, cache, ids)
    finally:
        torch_attention.WINDOW_SCORERS[:] = [kernel]
    assert calls and all(calls)  # every window scored by the kernel
    assert [layer.stored_length() for layer in cache.layers] == [
        layer.stored_length() for layer in base.layers
    ]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
