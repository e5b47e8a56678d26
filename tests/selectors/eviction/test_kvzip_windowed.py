"""KVzip on models with windowed layers: the global layers are compressed by the context pass, the windowed
ones keep the model's own window and store none of the reconstruction; a model without a global layer, or
``apply_to=all`` over windowed layers, is refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers import stream_logits
from zoo import HYBRID, make_family

from kvcompress import build_cache, compress_context
from kvcompress.core.model_window import ModelWindowLayer

KVZIP = {"compression_ratio": None, "context_chunk": 16, "sink_tokens": 2, "budget_scope": "layer"}
IDS = torch.randint(2, 90, (1, 48), generator=torch.Generator().manual_seed(4))


def _after_pass(model, budget: int):
    cache = build_cache("kvzip", model, budget=budget, **KVZIP)
    stream_logits(model, IDS[:, :40], cache, 40)
    info = compress_context(model, cache, IDS[:, :40])
    return cache, info, stream_logits(model, IDS[:, 40:], cache, 1)


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "cohere2"])
def test_global_layers_are_compressed_and_windowed_layers_keep_the_models_window(family):
    model = make_family(family)
    cache, info, _ = _after_pass(model, budget=8)
    assert info["context_pass"] is True
    for kind, layer in zip(HYBRID, cache.layers, strict=True):
        if kind == "sliding_attention":
            assert isinstance(layer, ModelWindowLayer) and layer.stats()["tokens_evicted"] == 0
            assert layer.stored_length() <= layer.window  # the model's window: no reconstruction token
        else:
            assert layer.context_passes == 1 and layer.stored_length() == 8 + 8  # budget, 8 decode tokens


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_a_covering_budget_gives_the_logits_of_full_after_the_pass(family):
    """Nothing evicted: the decode logits after the pass equal full's, so no layer stored the pass."""
    model = make_family(family)
    _, _, got = _after_pass(model, budget=100)
    full = build_cache("full", model)
    stream_logits(model, IDS[:, :40], full, 40)
    want = stream_logits(model, IDS[:, 40:], full, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_model_with_no_global_layer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"kvzip: every layer of model 'mistral' is windowed"):
        build_cache("kvzip", make_family("mistral"), budget=8, **KVZIP)


def test_apply_to_all_over_windowed_layers_is_refused_at_build():
    with pytest.raises(ValueError, match=r"kvzip.apply_to=all: layers \[0, 2\].*apply_to=full_attention"):
        build_cache("kvzip", make_family("gemma3"), budget=8, apply_to="all", **KVZIP)
