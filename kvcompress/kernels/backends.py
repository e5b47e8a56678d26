"""Attention backends: each declares which plans it serves (read form, device, dtype, probabilities) and
runs them. Importing this module registers them with ``kvcompress.core.executor``, which takes the first
that serves a plan (in the order triton, cpu, torch, sdpa, eager).

- ``triton``: the Triton kernels (``kvcompress.kernels.triton_backend``) on CUDA tensors: scored and
  grouped dense decode, KIVI codes, Quest pages (a CPU only under Triton's interpreter, for tests).

- ``cpu``: the C++ kernels (``kvcompress.kernels``): KIVI sums from packed codes and Quest pages read in
  place, on CPU tensors where the kernel built (pages: float32 keys).
- ``torch``: attention written in torch ops: the grouped decode form that also returns the probabilities
  score-based selectors read (``fused.decode_attention``), KIVI's tensor and compiled forms, and latents
  (``kvcompress.kernels.fused_low_rank.attend``: its parts pick their own C++ kernels on a CPU).
- ``sdpa`` / ``eager``: the model's own kernels over dense key/value, whichever the model was installed
  with (``attention.set_backend``); eager is the model's own eager function (soft-capping, sinks).

A compact read that names a backend (``quant.backend: cpu``) is served by that one alone
(``Plan.asks_other``); under ``auto`` by the first that serves it.

A new backend (the GPU kernels) subclasses ``executor.Backend`` and is added by ``executor.register``.
"""

from __future__ import annotations

import torch

from kvcompress import kernels
from kvcompress.core import kernel_slots
from kvcompress.core.executor import Backend, register
from kvcompress.core.fused import decode_attention
from kvcompress.core.masks import causal
from kvcompress.core.plan import Call, Plan
from kvcompress.kernels import flash_lse, fused_low_rank, fused_pages, fused_quant, triton_backend
from kvcompress.kernels.triton_backend import Triton


def _dense_only(plan: Plan) -> str | None:
    return None if plan.form == "dense" else f"reads dense key/value only, not {plan.form}"


class ModelKernel(Backend):
    """One of the model's own kernels over dense key/value: the one the model was installed with."""

    def missing(self, plan, call):
        if call.configured != self.name:
            return f"the model was installed with {call.configured!r}"
        return _dense_only(plan)


class Sdpa(ModelKernel):
    """``torch.nn.functional.scaled_dot_product_attention`` as transformers calls it; with ``probs: lse``,
    each query's log-sum-exp too where SDPA's kernel returns it (``flash_lse``), else None."""

    name = "sdpa"

    def run(self, plan, call):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        r = plan.read
        if plan.probs == "lse":
            found = flash_lse.attention_with_lse(call, r.key, r.value, r.mask)
            if found is not None:
                return found
        out, _ = sdpa_attention_forward(
            call.module, call.query, r.key, r.value, r.mask, scaling=call.scaling, **call.kwargs
        )
        return out, None


class Eager(ModelKernel):
    """The model's own eager attention function (its soft-capping, sinks, dropout)."""

    name = "eager"

    def run(self, plan, call):
        r, fn = plan.read, model_eager(call.module)
        mask = additive(r.mask, call.query, r.key)
        kw = {"scaling": call.scaling, "dropout": call.dropout, **call.kwargs}
        out, _ = fn(call.module, call.query, r.key, r.value, mask, **kw)
        return out, None


def model_eager(module):
    """The model's own eager attention (its softcapping, sinks, dropout), else ``eager_attention``."""
    import sys

    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", eager_attention)


def eager_attention(module, query, key, value, mask, scaling, **kwargs):
    """Reference attention: softmax in float32, as the models' own eager path. Shapes (B, H, q, D)."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, q, T)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    elif query.shape[2] > 1:
        allowed = causal(query.shape[2], key.shape[2], query.device)  # (q, T)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def additive(mask: torch.Tensor | None, query, key) -> torch.Tensor | None:
    """The additive float mask eager attention functions add to their logits: from a boolean mask, or the
    plain causal one when the mask is None (the models' eager functions never add causality themselves)."""
    q, t = query.shape[2], key.shape[2]
    if mask is None and q == 1:
        return None
    if mask is None:
        mask = causal(q, t, query.device)[None, None]
    if mask.dtype != torch.bool:
        return mask
    zeros = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)
    return zeros.masked_fill_(~mask, torch.finfo(query.dtype).min)


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
            return why
        if plan.form == "dense":
            if plan.read.mask is not None:
                return "no mask"
            return None if plan.grouped or plan.probs == "last" else "serves grouped or scored decode only"
        if plan.form == "kivi":
            # auto: not on a CPU, where the tensor forms measured slower than the dense read
            if plan.read.backend == "auto" and call.query.device.type == "cpu":
                return "KIVI codes on a CPU only when asked for by name (quant.backend: torch)"
            return None
        return f"reads {plan.form} in place on a CPU only"

    def run(self, plan, call):
        r, q = plan.read, call.query
        if plan.form == "dense":
            return decode_attention(q, r.key, r.value, call.scaling, plan.probs == "last")
        if plan.form == "latent":
            return fused_low_rank.attend(q, call.scaling, r), None
        # the tensor form picks itself: compiled from COMPILE_MIN_TOKENS quantized tokens, else eager
        return fused_quant.tensor_attention("auto", q, *_kivi_args(r, call.scaling)), None


def _kivi_args(r, scaling: float) -> tuple:
    return r.keys, r.values, r.key_res, r.value_res, scaling, r.bits, r.group


class Cpu(Backend):
    """The C++ kernels of ``kvcompress.kernels`` on float32 CPU tensors."""

    name = "cpu"
    KERNEL = {"kivi": "quant_attention", "pages": "page_attention"}

    def missing(self, plan, call):
        q = call.query
        if plan.form not in self.KERNEL:
            return f"reads KIVI codes and Quest pages only, not {plan.form}"
        if q.device.type != "cpu":
            return f"CPU tensors only, not {q.device.type}"
        why = plan.asks_other(self.name) or _plain_decode(plan, call)
        if why:
            return why
        if plan.form == "pages" and not _in_place(plan.read.key):
            return f"float32 keys with unit stride only, not {plan.read.key.dtype}"
        kernel = self.KERNEL[plan.form]
        if kernels.load(kernel) is None:
            return f"the C++ kernel {kernel} did not build: {kernels.why(kernel)}"
        return None

    def run(self, plan, call):
        r, q = plan.read, call.query
        if plan.form == "kivi":
            return fused_quant.attend(q, *_kivi_args(r, call.scaling), "kernel"), None
        return fused_pages.attend(q, call.scaling, r.key, r.value, r.pages, r.block, r.total), None


def _in_place(key: torch.Tensor) -> bool:
    return key.dtype == torch.float32 and key.stride(-1) == 1


# kernels lent to selectors and storage for steps outside attention (``kvcompress.core.kernel_slots``)
kernel_slots.register("window_scores", triton_backend.window_scores)  # prefill score windows, keys' own dtype
kernel_slots.register("select_pages", fused_pages.select)  # Quest's page choice in one C++ call
kernel_slots.register("turn_keys", fused_low_rank.turn_keys)  # pre-RoPE keys turned by the cos/sin table
for _backend in (Eager(), Sdpa(), Torch(), Cpu(), Triton()):  # each goes first: triton, cpu, torch, ...
    register(_backend)
