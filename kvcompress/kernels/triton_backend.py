"""The ``triton`` attention backend: the kernels of ``kvcompress.kernels.triton_attention`` behind the plan
executor, for decode steps on CUDA tensors.

It serves the scored and grouped dense reads of the eviction selectors (output and the decode query's
probabilities from one pass; masks of padded rows and per-head evictions included), KIVI's packed codes
plus the exact window, and Quest's pages read in place. On a CPU it serves nothing unless asked for
(``on_cpu()``), and then only under Triton's interpreter: that is how the tests run whole models through
the GPU kernels on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

from kvcompress.core import executor
from kvcompress.core.executor import Backend
from kvcompress.core.plan import Call, Plan

_STATE = {"cpu": False}


@contextlib.contextmanager
def on_cpu():
    """Serve CPU tensors too, under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton was
    first imported); for tests: the interpreter is far slower than the CPU backends."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the triton backend runs CPU tensors only under TRITON_INTERPRET=1, set before import"
        )
    saved, _STATE["cpu"] = _STATE["cpu"], True
    executor.forget()  # the backends' answers for CPU plans change
    try:
        yield
    finally:
        _STATE["cpu"] = saved
        executor.forget()


@functools.cache
def available() -> str | None:
    """None where triton imports, else why not (looked up once)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'kvcompress[test]' or triton)"
    return None


def _valid(mask, kv_heads: int, heads: int):
    """A boolean decode mask (B or 1, 1 or H_kv or H, 1, T) as key validity (B or 1, 1 or H_kv, T), or why
    not. A mask over the H query heads is a layer's per-KV-head mask repeated over each group
    (``layer.expand_heads``): one head of each group is read."""
    if mask is None:
        return None, None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[2] != 1:
        return None, f"boolean decode masks only, not {mask.dtype} {tuple(mask.shape)}"
    if mask.shape[1] == heads and heads != kv_heads:
        return mask[:, :: heads // kv_heads, 0], None
    if mask.shape[1] not in (1, kv_heads):
        return None, f"a mask over {mask.shape[1]} heads is not a key mask per KV head ({kv_heads})"
    return mask[:, :, 0], None


class Triton(Backend):
    """Decode attention in Triton kernels (CUDA; a CPU only under the interpreter, inside ``on_cpu()``)."""

    name = "triton"

    def missing(self, plan: Plan, call: Call) -> str | None:
        q = call.query
        if q.device.type != "cuda" and not (q.device.type == "cpu" and _STATE["cpu"]):
            return f"CUDA tensors only, not {q.device.type} (a CPU only under the interpreter, on_cpu())"
        why = plan.asks_other(self.name) or available()
        if why:
            return why
        if not call.plain:
            return "plain softmax only (the model adds soft-capping, sinks or dropout)"
        if q.shape[2] != 1:
            return f"one decode query only, not {q.shape[2]}"
        return self._form(plan, q)

    def _form(self, plan: Plan, q) -> str | None:
        r = plan.read
        if plan.form == "dense":
            if not (plan.grouped or plan.probs == "last"):
                return "serves grouped or scored dense reads (the model's own kernel serves plain ones)"
            return _valid(r.mask, r.key.shape[1], q.shape[1])[1]
        if plan.form == "kivi" and (r.key_axis != "channel" or plan.probs != "none"):
            return "reads KIVI's own layout (keys per channel) without probabilities only"
        if plan.form == "pages" and plan.probs != "none":
            return "no probabilities from pages read in place"
        if plan.form in ("kivi", "pages"):
            return None
        return f"no kernel reads {plan.form}"

    def run(self, plan: Plan, call: Call):
        from kvcompress.kernels import triton_attention as ta

        r, q, s = plan.read, call.query, call.scaling
        if plan.form == "dense":
            valid = _valid(r.mask, r.key.shape[1], q.shape[1])[0]
            return ta.dense(q, r.key, r.value, s, valid, probs=plan.probs == "last")
        if plan.form == "kivi":
            return ta.kivi(
                q, tuple(r.keys), tuple(r.values), r.key_res, r.value_res, s, r.bits, r.group
            ), None
        return ta.pages_attention(q, r.key, r.value, r.pages, r.block, r.total, s), None


def window_scores(query, key, scaling: float, valid=None):
    """``torch_attention.window_scores`` in Triton where this backend would serve the tensors, else None."""
    cuda, cpu = query.device.type == "cuda", query.device.type == "cpu" and _STATE["cpu"]
    if not (cuda or cpu) or available():
        return None
    if valid is not None and (valid.dim() != 3 or valid.shape[1] not in (1, key.shape[1])):
        return None
    from kvcompress.kernels import triton_attention as ta

    return ta.window_scores(query, key, scaling, valid)
