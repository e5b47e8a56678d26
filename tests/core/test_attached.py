"""Scoped use: ``with kvcompress.attached(model)`` changes the model only inside the block, and ``detach``
undoes what ``build_cache`` did; afterwards the model is exactly as it was (config, attention
implementation, hooks) and computes what it computed before."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from transformers import DynamicCache

import kvcompress
from kvcompress import build_cache

IDS = torch.randint(2, 90, (1, 20), generator=torch.Generator().manual_seed(8))


def _state(model) -> tuple:
    """What a change to the model would show: its config (as a dict, with the attention implementation),
    every attribute the model holds, and its forward pre-hooks."""
    config = {**model.config.to_dict(), "impl": model.config._attn_implementation}
    config["extra"] = sorted(vars(model.config))
    return config, sorted(vars(model)), len(model._forward_pre_hooks), len(model.model._forward_pre_hooks)


@torch.inference_mode()
def _own_logits(model) -> torch.Tensor:
    return model(IDS, past_key_values=DynamicCache(config=model.config)).logits


@torch.inference_mode()
def _policy_logits(model, name="h2o") -> torch.Tensor:
    cache = build_cache(name, model, budget=12, recent=2)
    return torch.cat([model(IDS[:, t : t + 1], cache=cache).logits for t in range(IDS.shape[1])], 1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_model_is_exactly_as_it_was_after_the_block(attn):
    model = make_tiny("llama", attn=attn)
    before, own = _state(model), _own_logits(model)
    fresh = make_tiny("llama", attn=attn)
    with kvcompress.attached(model):
        assert model.config._attn_implementation == "kvcompress"
        inside = _policy_logits(model)
    assert _state(model) == before
    assert torch.equal(_own_logits(model), own)
    torch.testing.assert_close(inside, _policy_logits(fresh))  # the same as build_cache's permanent install


def test_an_error_inside_the_block_still_restores_the_model():
    model = make_tiny("llama")
    before = _state(model)
    with pytest.raises(RuntimeError, match="inside"), kvcompress.attached(model):
        raise RuntimeError("inside")
    assert _state(model) == before


def test_an_installed_model_stays_installed_and_detach_undoes_build_cache():
    model = make_tiny("llama")
    before, own = _state(model), _own_logits(model)
    build_cache("full", model)  # installs for good
    installed = _state(model)
    assert installed != before
    with kvcompress.attached(model):
        pass
    assert _state(model) == installed
    kvcompress.detach(model)
    assert _state(model) == before
    assert torch.equal(_own_logits(model), own)
