"""Knorm against a float64 reference: each (layer, KV head) keeps exactly its lowest-norm keys, sized by the
budget or the ratio; the prompt is cut once (kvpress's default) and decode tokens append, or with
``evict_at: always`` each decode step drops the highest-norm key; no attention probabilities are asked."""

from __future__ import annotations

import pytest
import torch
from test_keydiff import ids_of

from kvcompress import build_cache
from kvcompress.core.cache import make_policy
from kvcompress.core.policy import ModelSpec
from kvcompress.selectors.eviction.knorm import KnormPolicy, knorm_scores

D = 8
SPEC = ModelSpec(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=D, max_positions=128)
G = torch.Generator().manual_seed(11)
IDS = torch.randint(2, 95, (1, 48), generator=G)
STEPS = torch.randint(2, 95, (1, 5), generator=G)


def lowest_norms(keys: torch.Tensor, k: int) -> list:
    """Indices of the ``k`` keys (B, H, T, D) of smallest float64 L2 norm, sorted per row and head."""
    return keys.double().norm(dim=-1).topk(k, dim=-1, largest=False).indices.sort(dim=-1).values.tolist()


@torch.inference_mode()
def prefill(model, cache, decode: int = 0) -> None:
    model(IDS, cache=cache)
    for i in range(decode):
        model(STEPS[:, i : i + 1], cache=cache)


def test_scores_are_minus_the_norm_in_at_least_float32():
    keys = torch.randn(2, 3, 17, D, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(knorm_scores(keys).double(), -keys.double().norm(dim=-1), atol=1e-6, rtol=0)
    assert knorm_scores(keys.bfloat16()).dtype == torch.float32  # low-precision keys do not tie (kvpress)
    assert knorm_scores(keys.double()).dtype == torch.float64


def test_the_registry_config_is_the_class_at_kvpress_defaults():
    policy = make_policy("knorm")
    assert policy == KnormPolicy() and policy.name == "knorm"
    assert policy.evicts == "prefill" and policy.compression_ratio == 0.5  # ScorerPress: the prompt, once
    assert not hasattr(policy, "recent")  # kvpress protects no recent window


@pytest.mark.parametrize("sizes,kept", [({"budget": 12, "compression_ratio": None}, 12),
                                        ({"compression_ratio": 0.25}, 36), ({}, 24)])  # fmt: skip
def test_each_layer_and_kv_head_keeps_exactly_its_lowest_norm_prompt_keys(llama, sizes, kept):
    """The prompt's keys are the same with and without eviction (it happens after the step's attention), so
    a full cache's keys are the reference: per layer and KV head the ``kept`` of smallest norm stay."""
    full, cache = build_cache("full", llama), build_cache("knorm", llama, **sizes)
    prefill(llama, full)
    prefill(llama, cache)
    for layer, ref in zip(cache.layers, full.layers, strict=True):
        assert layer.stored_length() == kept and layer.evicted == 48 - kept
        assert ids_of(layer.keys, ref.keys) == lowest_norms(ref.keys, kept)


def test_prefill_cuts_the_prompt_once_and_decode_tokens_append(llama):
    cache = build_cache("knorm", llama, budget=12, compression_ratio=None)
    prefill(llama, cache, decode=5)
    for layer in cache.layers:
        assert layer.stored_length() == 12 + 5 and layer.evicted == 48 - 12
        assert layer.stats()["evict_at"] == "prefill"
        assert layer.stats()["attention_backends"] == {"sdpa": 6}  # the model's own kernel: no scores asked


def test_evicting_always_drops_the_highest_norm_key_at_each_decode_step():
    keys = torch.randn(1, 2, 30, D, generator=torch.Generator().manual_seed(1))
    layer = KnormPolicy(budget=12, compression_ratio=None, evict_at="always").layer(0, SPEC)
    out, _ = layer.update(keys[:, :, :20], keys[:, :, :20] * 2)
    layer.observe_attention(torch.randn(1, 2, 20, D), out, 1.0)
    assert ids_of(layer.keys, keys) == lowest_norms(keys[:, :, :20], 12)
    for t in range(20, 30):  # one token in, the highest norm of the 13 out: the 12 lowest of all seen
        out, _ = layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1] * 2)
        layer.observe_attention(torch.randn(1, 2, 1, D), out, 1.0)
        assert ids_of(layer.keys, keys) == lowest_norms(keys[:, :, : t + 1], 12)
        assert torch.equal(layer.values.sort(dim=2).values, (layer.keys * 2).sort(dim=2).values)
    assert layer.stored_length() == 12 and layer.evicted == 30 - 12
