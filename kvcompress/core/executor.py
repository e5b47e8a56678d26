"""Runs a layer's ``Plan`` with the first registered backend (``BACKENDS``) that serves it.

A backend subclasses ``Backend`` and is added by ``register``; the package's own (``sdpa``, ``eager``,
``torch``, and ``cpu`` for the C++ kernels) are registered by ``kvcompress.kernels.backends`` when
``kvcompress`` is imported, a new one (the GPU kernels) the same way.

The executor owns the branches of a step: a compact read no backend serves is made dense (the layer's
``plan.dense()``) and tried again; a plan with no dense form that no backend serves is refused, naming what
each backend lacks. The backend that ran is returned, for the layer's counters and every result.
"""

from __future__ import annotations

import torch

from kvcompress.core.plan import Call, Plan


class Backend:
    """One way to run attention. ``missing`` says why a plan is not served (None: served); ``run`` returns
    the output (B, q, H, D) and the decode query's probabilities (B, H_kv, 1, T) float32 or None (with
    ``probs: lse``, each query's log-sum-exp (B, H, q) float32 or None)."""

    name = ""

    def missing(self, plan: Plan, call: Call) -> str | None:
        raise NotImplementedError

    def run(self, plan: Plan, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError


BACKENDS: list[Backend] = []  # tried in order


def register(backend: Backend, first: bool = True) -> None:
    """Add ``backend`` to those the executor tries (before the others unless ``first`` is False); one of the
    same name is replaced."""
    BACKENDS[:] = [b for b in BACKENDS if b.name != backend.name]
    BACKENDS.insert(0 if first else len(BACKENDS), backend)


def names() -> list[str]:
    return [b.name for b in BACKENDS]


class Unserved(RuntimeError):
    """No attention backend serves a plan that has no dense form."""


def choose(plan: Plan, call: Call) -> tuple[Backend | None, dict[str, str]]:
    """The first backend that serves ``plan``, and why each one before it did not."""
    why: dict[str, str] = {}
    for backend in BACKENDS:
        missing = backend.missing(plan, call)
        if missing is None:
            return backend, why
        why[backend.name] = missing
    return None, why


def execute(plan: Plan, call: Call) -> tuple[torch.Tensor, torch.Tensor | None, tuple[str, str]]:
    """Output (B, q, H, D), the decode query's probabilities (B, H_kv, 1, T) or None, and what ran: the
    backend's name and the form of the read it ran (``dense`` after a fallback)."""
    backend, why = choose(plan, call)
    if backend is None and plan.dense is not None:
        dense = Plan(plan.dense(), probs=plan.probs, grouped=plan.grouped)
        return execute(dense, call)
    if backend is None:
        q = call.query
        lacks = "; ".join(f"{name}: {reason}" for name, reason in why.items())
        raise Unserved(
            f"no attention backend serves a {plan.form} read ({_detail(plan)}on {q.device.type}, {q.dtype}) "
            f"and it has no dense form: {lacks}"
        )
    out, probs = backend.run(plan, call)
    if plan.done is not None:
        plan.done()
    return out, probs, (backend.name, plan.form)


def _detail(plan: Plan) -> str:
    mode = getattr(plan.read, "mode", None)
    return "" if mode is None else f"mode {mode!r}, "


class Standalone(torch.nn.Module):
    """The attention module for a plan run by hand (``execute(plan, Call(Standalone(), ...))``): plain causal
    softmax attention, no soft-capping, sinks or dropout."""

    is_causal = True

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"attn_logit_softcapping": None})()
        self.eval()
