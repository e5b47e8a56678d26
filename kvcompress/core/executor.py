"""Runs a layer's ``Plan`` with the first registered backend (``BACKENDS``) that serves it.

The model's own kernels over a dense read, ``sdpa`` and ``eager`` (transformers' functions, the one place
outside ``attention.py`` and ``cache.py`` that calls into transformers' attention), are built in, last. A
backend subclasses ``Backend`` and is added by ``register``: the package's kernels (``torch``, ``cpu`` for
the C++ kernels, ``triton``) by ``kvcompress.kernels.backends.install()``, which ``kvcompress`` calls when it
is imported, a new one (the GPU kernels) the same way.

The choice is made once per plan signature (``signature``: the read's form and the backend it asks for, the
probabilities asked for, the query's device, dtype, heads and length, the mask's kind, the model's kernel) and
remembered with the backend's kernel for it (``Backend.kernel``), so a steady decode step asks no backend
anything and calls the kernel's own entry; registering a backend forgets the choices. A
plan that no backend serves gets ``None`` from ``backend_for``; ``refusal`` names what each backend lacks.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace

import torch

from kvcompress.core import kernel_slots
from kvcompress.core.masks import causal
from kvcompress.core.plan import Call, Plan


class Backend:
    """One way to run attention. ``missing`` says why a plan is not served (None: served); it may read only
    what ``signature`` holds, since its answer is remembered per signature. ``run`` returns the output
    (B, q, H, D) and the decode query's probabilities (B, H_kv, 1, T) float32 or None (with ``probs: lse``,
    each query's log-sum-exp (B, H, q) float32 or None)."""

    name = ""

    def missing(self, plan: Plan, call: Call) -> str | None:
        raise NotImplementedError

    def run(self, plan: Plan, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def kernel(self, plan: Plan):
        """What runs a plan of this signature: a function ``(plan, call)`` returning what ``run`` does. The
        executor remembers it with the choice, so a step calls the kernel's own entry; ``run`` by default, a
        backend whose kernel takes the plan directly returns that function."""
        return self.run


class ModelKernel(Backend):
    """One of the model's own kernels over dense key/value: the one the model was installed with."""

    def missing(self, plan, call):
        if call.configured != self.name:
            return f"the model was installed with {call.configured!r}"
        return None if plan.form == "dense" else f"reads dense key/value only, not {plan.form}"


class Sdpa(ModelKernel):
    """``torch.nn.functional.scaled_dot_product_attention`` as transformers calls it; with ``probs: lse``,
    each query's log-sum-exp too where a kernel lent in the ``sdpa_lse`` slot returns it, else None."""

    name = "sdpa"

    def run(self, plan, call):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        r = plan.read
        if plan.probs == "lse":
            found = kernel_slots.first("sdpa_lse", call, r.key, r.value, r.mask)
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


class Parts(Backend):
    """A ``Heads`` read: each part's query heads (the query heads of its KV groups) attend over that part's
    own read with the backend that serves it (chosen like any plan's), and the outputs are put back in the
    model's head order. No probabilities: a selector that ranks by attention does not read parts."""

    name = "parts"

    def missing(self, plan, call):
        if plan.form != "heads":
            return f"reads KV heads held apart only, not {plan.form}"
        return None if plan.probs == "none" else f"returns no probabilities (probs {plan.probs!r} asked)"

    def run(self, plan, call):
        q = call.query  # (B, H, q, D)
        group = q.shape[1] // sum(len(heads) for heads, _ in plan.read.parts)
        out = None
        for heads, read in plan.read.parts:
            idx = query_heads(heads, group, q.device)
            part_plan, part_call = Plan(read, "none", plan.grouped), replace(call, query=q[:, idx])
            found = chosen(part_plan, part_call)
            if found is None:
                raise refusal(part_plan, part_call)
            got = found[1](part_plan, part_call)[0]  # (B, q, h, D)
            if out is None:
                out = got.new_empty(*got.shape[:2], q.shape[1], got.shape[-1])
            out[:, :, idx] = got
        return out, None


@functools.cache
def query_heads(kv_heads: tuple, group: int, device) -> torch.Tensor:
    """The query heads (int64) of the KV heads ``kv_heads``, ``group`` query heads per KV head (made once per
    part and device: a decode step builds no index tensor)."""
    return (
        torch.tensor(kv_heads, device=device)[:, None] * group + torch.arange(group, device=device)
    ).flatten()


BACKENDS: list[Backend] = [Sdpa(), Eager(), Parts()]  # tried in order; registered ones go before these
_CHOSEN: dict[tuple, tuple | None] = {}  # signature -> (backend, its kernel) that serves it (None: none does)


def register(backend: Backend, first: bool = True) -> None:
    """Add ``backend`` to those the executor tries (before the others unless ``first`` is False); one of the
    same name is replaced."""
    BACKENDS[:] = [b for b in BACKENDS if b.name != backend.name]
    BACKENDS.insert(0 if first else len(BACKENDS), backend)
    forget()


def unregister(name: str) -> None:
    """Remove the backend called ``name`` (if registered)."""
    BACKENDS[:] = [b for b in BACKENDS if b.name != name]
    forget()


def forget() -> None:
    """Drop the remembered choices (a backend was registered, or one's conditions changed)."""
    _CHOSEN.clear()


def names() -> list[str]:
    return [b.name for b in BACKENDS]


class Unserved(RuntimeError):
    """No attention backend serves a plan that has no dense form."""


def signature(plan: Plan, call: Call) -> tuple:
    """What a backend's ``missing`` may depend on: equal signatures get the same backend."""
    read, q = plan.read, call.query
    mask = getattr(read, "mask", None)
    kind = None if mask is None else (mask.dtype, mask.dim(), mask.shape[1], mask.shape[2])
    key = getattr(read, "key", None)
    layout = None if key is None else (key.dtype, key.shape[1], key.stride(-1) == 1)
    form = (read.form, getattr(read, "backend", None), layout, plan.probs, plan.grouped)
    return (*form, q.device.type, q.dtype, q.shape[1], q.shape[2] == 1, kind, call.configured, call.plain)


def choose(plan: Plan, call: Call) -> tuple[Backend | None, dict[str, str]]:
    """The first backend that serves ``plan``, and why each one before it did not."""
    why: dict[str, str] = {}
    for backend in BACKENDS:
        missing = backend.missing(plan, call)
        if missing is None:
            return backend, why
        why[backend.name] = missing
    return None, why


def chosen(plan: Plan, call: Call) -> tuple | None:
    """The backend that serves ``plan`` (``choose``) and its kernel for it (``Backend.kernel``), asked once
    per ``signature``; None when no backend does."""
    sig = signature(plan, call)
    if sig not in _CHOSEN:
        backend = choose(plan, call)[0]
        _CHOSEN[sig] = None if backend is None else (backend, backend.kernel(plan))
    return _CHOSEN[sig]


def backend_for(plan: Plan, call: Call) -> Backend | None:
    """The backend that serves ``plan`` (``chosen``); None when none does."""
    found = chosen(plan, call)
    return None if found is None else found[0]


def refusal(plan: Plan, call: Call) -> Unserved:
    """The error for a plan no backend serves, naming what each one lacks."""
    q = call.query
    lacks = "; ".join(f"{name}: {reason}" for name, reason in choose(plan, call)[1].items())
    asked = getattr(plan.read, "backend", "auto")
    detail = "" if asked == "auto" else f"backend {asked!r} asked for, "
    return Unserved(
        f"no attention backend serves a {plan.form} read ({detail}on {q.device.type}, {q.dtype}) and it has "
        f"no dense form: {lacks}"
    )


def execute(plan: Plan, call: Call) -> tuple[torch.Tensor, torch.Tensor | None, tuple[str, str]]:
    """Output (B, q, H, D), the decode query's probabilities (B, H_kv, 1, T) or None, and what ran (the
    backend's name and the read's form); ``Unserved`` when no backend serves the plan."""
    found = chosen(plan, call)
    if found is None:
        raise refusal(plan, call)
    out, probs = found[1](plan, call)
    return out, probs, (found[0].name, plan.read.form)
