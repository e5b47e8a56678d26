"""Attention backends: each declares which plans it serves (read form, device, dtype, probabilities) and
runs them. Importing this module registers them with ``kvcompress.core.executor``, which takes the first
that serves a plan (in the order triton, cpu, torch, then the model's own sdpa and eager, built into the
executor).

- ``triton``: the Triton kernels (``kvcompress.kernels.triton_backend``) on CUDA tensors: scored and
  grouped dense decode, KIVI codes, Quest pages (a CPU only under Triton's interpreter, for tests).

- ``cpu``: the C++ kernels (``kvcompress.kernels``): KIVI sums from packed codes (KIVI's and the rotated
  codes of ``turboquant``, ``fused_turbo``) and Quest pages read in place, on CPU tensors where the kernel
  built (pages: float32 keys).
- ``torch``: attention written in torch ops: the grouped decode form that also returns the probabilities
  score-based selectors read (``torch_attention.decode_attention``), KIVI's tensor and compiled forms, and
  latents (``kvcompress.kernels.fused_low_rank.attend``: its parts pick their own C++ kernels on a CPU).
- ``sdpa`` / ``eager`` (in ``kvcompress.core.executor``): the model's own kernels over dense key/value,
  whichever the model was installed with (``attention.set_backend``); eager is the model's own eager
  function (soft-capping, sinks).

A compact read that names a backend (``quant.backend: cpu``) is served by that one alone
(``Plan.asks_other``); under ``auto`` by the first that serves it.

A new backend (the GPU kernels) subclasses ``executor.Backend`` and is added by ``executor.register``.
"""

from __future__ import annotations

import torch

from kvcompress import kernels
from kvcompress.core import executor, kernel_slots
from kvcompress.core.executor import Backend, register
from kvcompress.core.plan import Call, Plan
from kvcompress.core.torch_attention import decode_attention
from kvcompress.kernels import (
    flash_lse,
    fused_low_rank,
    fused_pages,
    fused_quant,
    fused_turbo,
    triton_backend,
)
from kvcompress.kernels.triton_backend import Triton


def _plain_decode(plan: Plan, call: Call) -> str | None:
    if not call.plain:
        return "plain softmax only (the model adds soft-capping, sinks or dropout)"
    if call.query.shape[2] != 1:
        return f"one decode query only, not {call.query.shape[2]}"
    return None


class Torch(Backend):
    """Attention in torch ops over one decode query per row (any device and dtype)."""

    name = "torch"

    def missing(self, plan, call):
        why = plan.asks_other(self.name) or _plain_decode(plan, call)
        if why or plan.form == "latent":
            return why or (None if plan.probs == "none" else "no probabilities from latents")
        if plan.form == "dense":
            if plan.read.mask is not None:
                return "no mask"
            return None if plan.grouped or plan.probs == "last" else "serves grouped or scored decode only"
        if plan.form in ("kivi", "rotated"):
            # auto: not on a CPU, where the C++ kernel reads codes (KIVI's tensor forms measured slower there)
            if plan.read.backend == "auto" and call.query.device.type == "cpu":
                return f"{plan.form} codes on a CPU only when asked for by name (backend: torch)"
            return _scored(plan)
        return f"reads {plan.form} in place on a CPU only"

    def run(self, plan, call):
        r, q = plan.read, call.query
        if r.form == "dense":
            return decode_attention(q, r.key, r.value, call.scaling, plan.probs == "last")
        if r.form == "latent":
            return fused_low_rank.attend(q, call.scaling, r), None
        if r.form == "rotated":
            return fused_turbo.attend(q, r, call.scaling, "matmul", plan.probs == "last")
        if plan.probs == "none" and r.key_axis == "channel":
            # the tensor form picks itself: compiled from COMPILE_MIN_TOKENS quantized tokens, else eager
            return fused_quant.tensor_attention("auto", q, *_kivi_args(r, call.scaling)), None
        return _kivi_scored(plan, call, "matmul")


def _kivi_args(r, scaling: float) -> tuple:
    return r.keys, r.values, r.key_res, r.value_res, scaling, r.bits, r.group


def _scored(plan: Plan) -> str | None:
    """A KIVI read returns the decode query's probabilities (``last``) or none, never a log-sum-exp."""
    return None if plan.probs in ("none", "last") else f"probabilities {plan.probs!r} from KIVI codes"


def _kivi_scored(plan: Plan, call: Call, impl: str):
    """The output and, where the selector asks, the probabilities, from the codes of either key layout."""
    r, scores = plan.read, plan.probs == "last"
    args = (r.keys, r.values, r.key_res, r.value_res, call.scaling, r.bits, r.group, impl, r.key_axis, scores)
    return fused_quant.attend_scored(call.query, *args)


class Cpu(Backend):
    """The C++ kernels of ``kvcompress.kernels`` on float32 CPU tensors."""

    name = "cpu"
    KERNEL = {"kivi": "quant_attention", "rotated": "quant_attention", "pages": "page_attention"}
    PLAN_KERNELS = {"kivi": fused_quant.plan_attention, "rotated": fused_turbo.plan_attention}

    def missing(self, plan, call):
        q = call.query
        if plan.form not in self.KERNEL:
            return f"reads KIVI or rotated codes and Quest pages only, not {plan.form}"
        if q.device.type != "cpu":
            return f"CPU tensors only, not {q.device.type}"
        why = plan.asks_other(self.name) or _plain_decode(plan, call)
        if why:
            return why
        if plan.form == "pages" and plan.probs != "none":
            return "no probabilities from pages read in place"
        if plan.form == "pages" and not _in_place(plan.read.key):
            return f"float32 keys with unit stride only, not {plan.read.key.dtype}"
        if plan.form in ("kivi", "rotated") and _scored(plan):
            return _scored(plan)
        kernel = self.KERNEL[plan.form]
        if kernels.load(kernel) is None:
            return f"the C++ kernel {kernel} did not build: {kernels.why(kernel)}"
        return None

    def kernel(self, plan):
        return self.PLAN_KERNELS.get(plan.form, self.run)

    def run(self, plan, call):
        r, q = plan.read, call.query
        if r.form in self.PLAN_KERNELS:
            return self.PLAN_KERNELS[r.form](plan, call)
        return fused_pages.attend(q, call.scaling, r.key, r.value, r.pages, r.block, r.total), None


def _in_place(key: torch.Tensor) -> bool:
    return key.dtype == torch.float32 and key.stride(-1) == 1


# kernels lent to selectors and storage for steps outside attention (``kvcompress.core.kernel_slots``)
LENT = {
    "window_scores": triton_backend.window_scores,  # prefill score windows, keys' own dtype
    "select_pages": fused_pages.select,  # Quest's page choice in one C++ call
    "turn_keys": fused_low_rank.turn_keys,  # pre-RoPE keys turned by the cos/sin table
    "sdpa_lse": flash_lse.attention_with_lse,  # SDPA's own log-sum-exp (kvzip)
}


def install() -> None:
    """Register these backends with the executor (each before the model's own, sdpa and eager: tried in
    the order triton, cpu, torch) and lend ``LENT``'s kernels to their slots. ``kvcompress/__init__.py``
    calls it once; calling it again changes nothing (a backend of the same name is replaced)."""
    for slot, kernel in LENT.items():
        kernel_slots.register(slot, kernel)
    for backend in (Torch(), Cpu(), Triton()):  # each inserted first: triton ends up first
        if not any(type(b) is type(backend) for b in executor.BACKENDS):
            register(backend)
