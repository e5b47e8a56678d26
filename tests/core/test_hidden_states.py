"""A layer that asks for its attention's input hidden states (KVzap) gets exactly this step's, through the
forward's own state: chunked prefill, decode steps, a left-padded batch; no other layer keeps them, and
``detach`` removes the hooks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from conftest import make_tiny

from kvcompress.core import attention
from kvcompress.core.cache import build_cache
from kvcompress.core.layer import PolicyLayer
from kvcompress.core.policy import Policy, Shape


class RecordLayer(PolicyLayer):
    """Keeps every token and the hidden states each step brought (B, q, hidden)."""

    wants_hidden = True

    def __init__(self, policy, layer_idx, spec, store):
        super().__init__(policy, layer_idx, spec, store)
        self.got = []

    def on_append(self, key_states, new_valid) -> None:
        self.got.append(self.hidden)


@dataclass
class RecordPolicy(Policy):
    layer_class = RecordLayer

    @property
    def name(self) -> str:
        return "record-hidden"

    def kept_tokens(self, s: Shape) -> int:
        return s.total


def reference_inputs(model, ids, chunks, mask=None) -> list[list[torch.Tensor]]:
    """Each layer's attention input per forward of ``ids`` in ``chunks``, seen by plain hooks on a model
    with transformers' own cache."""
    from transformers import DynamicCache

    seen = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda m, a, k: seen.setdefault(m.layer_idx, []).append(k["hidden_states"].clone()),
            with_kwargs=True,
        )
        for m in attention.attention_modules(model)
    ]
    cache, start = DynamicCache(config=model.config), 0
    with torch.inference_mode():
        for c in chunks:
            extra = {} if mask is None else {"attention_mask": mask[:, : start + c]}
            model(ids[:, start : start + c], cache=cache, **extra)
            start += c
    for h in hooks:
        h.remove()
    return [seen[i] for i in sorted(seen)]


def run(model, cache, ids, chunks, mask=None) -> None:
    start = 0
    with torch.inference_mode():
        for c in chunks:
            extra = {} if mask is None else {"attention_mask": mask[:, : start + c]}
            model(ids[:, start : start + c], cache=cache, **extra)
            start += c


def test_each_step_hands_the_layer_its_own_attention_input_in_chunked_prefill_and_decode():
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 19), generator=torch.Generator().manual_seed(0))
    chunks = [7, 5, 1, 1, 1, 4]
    want = reference_inputs(model, ids, chunks)
    cache = build_cache(RecordPolicy(), model)
    run(model, cache, ids, chunks)
    for layer, ref in zip(cache.layers, want, strict=True):
        assert [g.shape[1] for g in layer.got] == chunks
        for got, exp in zip(layer.got, ref, strict=True):
            torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-5)
        assert layer.hidden is got  # the step's own; the forward's state keeps nothing past its end


def test_a_padded_batch_hands_each_row_its_own_attention_input():
    model = make_tiny("llama")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 90, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # row 1: four tokens of left padding
    cache = build_cache(RecordPolicy(), model)
    run(model, cache, ids, [12], mask)
    alone = reference_inputs(model, ids[1:, 4:], [8])
    for layer, ref in zip(cache.layers, alone, strict=True):
        assert layer.got[0].shape == (2, 12, 16 * 4)
        torch.testing.assert_close(layer.got[0][1, 4:], ref[0][0], atol=1e-5, rtol=1e-4)


def test_only_a_cache_that_asks_installs_the_hooks_and_detach_removes_them():
    model = make_tiny("llama")
    build_cache("full", model)
    assert not getattr(model, attention.HIDDEN, False)
    n = len(getattr(model, attention.HOOKS))
    build_cache(RecordPolicy(), model)
    assert getattr(model, attention.HIDDEN) and len(getattr(model, attention.HOOKS)) == n + 3  # 3 layers
    full = build_cache("full", model)  # hooked, but a layer that does not ask is handed nothing
    run(model, full, torch.randint(2, 90, (1, 5)), [5])
    attention.detach(model)
    assert not hasattr(model, attention.HIDDEN) and not hasattr(model, attention.HOOKS)
    assert all(not m._forward_pre_hooks for m in attention.attention_modules(model))
