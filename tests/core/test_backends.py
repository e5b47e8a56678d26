"""Attention plans and backends: the executor runs a layer's plan with the first backend that serves it,
a new backend plugs in without touching a layer, and every result records the backend that ran."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import Standalone

from kvcompress import build_cache
from kvcompress.core import executor
from kvcompress.core.attention import set_backend
from kvcompress.core.executor import Unserved, execute
from kvcompress.core.plan import Call, Dense, Plan
from kvcompress.kernels import backends
from kvcompress.metrics.compression import attention_backends


def _decode(model, cache, ids) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(ids.shape[1])], dim=1)


def _ids(n: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, 90, (1, n), generator=torch.Generator().manual_seed(seed))


class Reference(executor.Backend):
    """A backend a user plugs in: kvcompress's reference eager attention over dense reads."""

    name = "reference"

    def missing(self, plan, call):
        return None if plan.form == "dense" else f"reads dense key/value only, not {plan.form}"

    def run(self, plan, call):
        r = plan.read
        out, _ = executor.eager_attention(call.module, call.query, r.key, r.value, r.mask, call.scaling)
        return out, None


@pytest.fixture
def reference_backend():
    saved = list(executor.BACKENDS)
    executor.register(Reference())
    yield
    executor.BACKENDS[:] = saved
    executor.forget()


def test_every_step_is_counted_under_the_backend_that_ran():
    """``full`` reads dense key/value through the model's SDPA at every layer-step, prefill included."""
    model, ids = make_tiny("llama"), _ids()
    cache = build_cache("full", model)
    _decode(model, cache, ids)
    assert attention_backends(cache) == {"sdpa": ids.shape[1] * len(cache.layers)}


def test_a_scoring_selector_reads_its_probabilities_from_the_grouped_torch_backend():
    model, ids = make_tiny("llama"), _ids(20)
    cache = build_cache("h2o", model, budget=8, recent=2)
    _decode(model, cache, ids)
    ran = attention_backends(cache)
    assert ran == {"torch": ids.shape[1] * len(cache.layers)}  # one query per step: the grouped form


def test_a_registered_backend_is_chosen_and_gives_the_same_logits(reference_backend):
    """A backend registered first serves every dense plan; the logits equal SDPA's to float rounding."""
    model, ids = make_tiny("llama"), _ids()
    ours = build_cache("full", model)
    logits = _decode(model, ours, ids)
    assert attention_backends(ours) == {"reference": ids.shape[1] * len(ours.layers)}
    executor.unregister("reference")
    sdpa = build_cache("full", model)
    torch.testing.assert_close(logits, _decode(model, sdpa, ids), atol=1e-5, rtol=1e-5)
    assert attention_backends(sdpa) == {"sdpa": ids.shape[1] * len(sdpa.layers)}


def test_a_plan_no_backend_serves_is_refused_naming_what_each_lacks(monkeypatch):
    """With no backend for dense reads, the executor says, per backend, what is missing."""
    monkeypatch.setattr(executor, "BACKENDS", [backends.Cpu()])
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    why = r"no attention backend serves a dense read .*cpu: reads KIVI or rotated codes and Quest pages only"
    with pytest.raises(Unserved, match=why):
        execute(Plan(Dense(k, k, None)), Call(Standalone(), q, 0.3, {}, "sdpa"))


def test_the_installed_backend_decides_between_sdpa_and_eager():
    from kvcompress.core.attention import set_backend

    model, ids = make_tiny("llama"), _ids()
    set_backend(model, "eager")
    cache = build_cache("full", model)
    _decode(model, cache, ids)
    assert attention_backends(cache) == {"eager": ids.shape[1] * len(cache.layers)}


@pytest.mark.parametrize("implementation", ["flex_attention"])
def test_a_model_kernel_no_backend_runs_is_refused_not_swapped(implementation):
    """A model loaded with another attention implementation is refused by name, the model left as it was."""
    model = make_tiny("llama", attn=implementation)
    with pytest.raises(
        ValueError, match=rf"attn_implementation='{implementation}', which no kvcompress attention"
    ):
        build_cache("full", model)
    assert model.config._attn_implementation == implementation
    set_backend(model, "sdpa")  # chosen by name: then it runs, recorded as sdpa
    cache = build_cache("full", model)
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
    assert attention_backends(cache) == {"sdpa": len(cache.layers)}  # one prefill step per layer


class Unmasked(Reference):
    """Serves dense reads without a mask only: its answer depends on the mask, which the signature holds."""

    name = "unmasked"

    def missing(self, plan, call):
        return "no mask only" if plan.read.mask is not None else super().missing(plan, call)


def test_the_remembered_choice_follows_the_signature_and_registering_forgets_it():
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    call = Call(Standalone(), q, 0.3, {}, "sdpa")
    masked = Plan(Dense(k, k, torch.ones(1, 1, 1, 5, dtype=torch.bool)))
    saved = list(executor.BACKENDS)
    try:
        assert executor.backend_for(Plan(Dense(k, k, None)), call).name == "sdpa"  # remembered
        executor.register(Unmasked())  # registering forgets: the new backend is asked
        assert executor.backend_for(Plan(Dense(k, k, None)), call).name == "unmasked"
        assert executor.backend_for(masked, call).name == "sdpa"  # another signature, another answer
        assert executor.signature(masked, call) != executor.signature(Plan(Dense(k, k, None)), call)
        executor.unregister("unmasked")
        assert executor.backend_for(Plan(Dense(k, k, None)), call).name == "sdpa"
    finally:
        executor.BACKENDS[:] = saved
        executor.forget()


class Direct(Reference):
    """A backend whose kernel takes the plan itself: the executor calls it, never ``run``."""

    name = "direct"
    calls = 0

    def kernel(self, plan):
        def entry(plan, call):
            Direct.calls += 1
            return super(Direct, self).run(plan, call)

        return entry

    def run(self, plan, call):
        raise AssertionError("run is not called where the backend names its kernel")


def test_a_step_calls_the_kernel_remembered_with_the_choice():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    call = Call(Standalone(), q, 0.3, {}, "sdpa")
    saved, Direct.calls = list(executor.BACKENDS), 0
    try:
        executor.register(Direct())
        out, _, ran = execute(Plan(Dense(k, v, None)), call)
        out2, _, _ = execute(Plan(Dense(k, v, None)), call)
        want, _ = executor.eager_attention(call.module, q, k, v, None, 0.3)
        assert ran == ("direct", "dense") and Direct.calls == 2
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(out2, want)
    finally:
        executor.BACKENDS[:] = saved
        executor.forget()


def test_the_cpu_backend_runs_kivi_reads_through_the_kernels_plan_entry():
    from kvcompress.kernels import fused_quant

    cpu = next(b for b in executor.BACKENDS if b.name == "cpu")
    assert cpu.kernel(Plan(Dense(torch.zeros(1), torch.zeros(1), None))) == cpu.run
    kivi = type("P", (), {"form": "kivi"})()
    assert cpu.kernel(kivi) is fused_quant.plan_attention


def test_importing_the_kernels_registers_nothing_until_install_is_called():
    import importlib

    from kvcompress.core import kernel_slots

    saved, lent = list(executor.BACKENDS), {k: list(v) for k, v in kernel_slots._LENT.items()}
    try:
        executor.BACKENDS[:] = [b for b in saved if b.name in ("sdpa", "eager")]
        for kernels in kernel_slots._LENT.values():
            kernels.clear()
        fresh = importlib.reload(backends)
        assert executor.names() == ["sdpa", "eager"] and not any(kernel_slots._LENT.values())
        fresh.install()
        fresh.install()  # once is enough: again changes nothing
        assert executor.names() == ["triton", "cpu", "torch", "sdpa", "eager"]
        assert all(len(kernel_slots.lent(slot)) == 1 for slot in kernel_slots.SLOTS)
    finally:
        executor.BACKENDS[:] = saved
        for slot, kernels in lent.items():
            kernel_slots._LENT[slot][:] = kernels
        executor.forget()
