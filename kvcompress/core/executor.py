"""Runs a layer's ``Plan`` with the first registered backend (``BACKENDS``) that serves it.

A backend subclasses ``Backend`` and is added by ``register``; the package's own (``sdpa``, ``eager``,
``torch``, and ``cpu`` for the C++ kernels) are registered by ``kvcompress.kernels.backends`` when
``kvcompress`` is imported, a new one (the GPU kernels) the same way.

The choice is made once per plan signature (``signature``: the read's form and the backend it asks for, the
probabilities asked for, the query's device, dtype, heads and length, the mask's kind, the model's kernel) and
remembered, so a steady decode step asks no backend anything; registering a backend forgets the choices. A
plan that no backend serves gets ``None`` from ``backend_for``; ``refusal`` names what each backend lacks.
"""

from __future__ import annotations

import torch

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


BACKENDS: list[Backend] = []  # tried in order
_CHOSEN: dict[tuple, Backend | None] = {}  # signature -> the backend that serves it (None: none does)


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


def backend_for(plan: Plan, call: Call) -> Backend | None:
    """The backend that serves ``plan`` (``choose``), asked once per ``signature``; None when none does."""
    sig = signature(plan, call)
    if sig not in _CHOSEN:
        _CHOSEN[sig] = choose(plan, call)[0]
    return _CHOSEN[sig]


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
    backend = backend_for(plan, call)
    if backend is None:
        raise refusal(plan, call)
    out, probs = backend.run(plan, call)
    return out, probs, (backend.name, plan.read.form)
