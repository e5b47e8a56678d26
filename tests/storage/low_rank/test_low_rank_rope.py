"""Pre-RoPE low-rank keys: full rank equal to ``full`` on Llama, Qwen2, partial rotary (Phi-3), scaled RoPE
(Llama-3, YaRN) and NoPE layers (SmolLM3), through the model's own rotary embedding inverted exactly (its own
tests: tests/storage/test_rope.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import stream_logits
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from zoo import ROPE, ROPE_TINY, make_rope_model

from kvcompress import build_cache
from kvcompress.selectors import LowRankPolicy
from kvcompress.storage.rope import model_ropes

FAMILIES = ["llama", "qwen2", "phi3_partial", "llama3", "yarn", "smollm3_nope"]


def policy(tmp_path, **kw):
    base = {"calibration_text": "random", "calibration_tokens": 64, "calibration_dir": str(tmp_path)}
    return LowRankPolicy(**{**base, **kw})


@pytest.mark.parametrize("keys", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("family", FAMILIES)
def test_full_rank_reproduces_full(family, keys, tokens, tmp_path):
    model = make_rope_model(family)
    ref = stream_logits(model, tokens, DynamicCache(config=model.config), chunk=5)
    for basis in ("joint", "head"):
        cache = build_cache(policy(tmp_path, rank=16, keys=keys, basis=basis), model)
        got = stream_logits(model, tokens, cache, chunk=5)
        assert cache.stats()[0]["tokens_projected"] == 48
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_nope_layers_skip_unrotation(tmp_path):
    model = make_rope_model("smollm3_nope")
    ropes = model_ropes(model, 3)
    assert [r is None for r in ropes] == [False, True, False]  # no_rope_layers = [1, 0, 1]
    cache = build_cache(policy(tmp_path, rank=4), model)
    assert [layer.store.rope is None for layer in cache.layers] == [False, True, False]


def test_positions_are_the_models_own(tokens, tmp_path):
    """Explicit position_ids (a prompt starting at 100) reach the store; reads rotate keys back at them."""
    model = make_rope_model("llama")
    cache = build_cache(policy(tmp_path, rank=16, recent=2), model)
    pos = torch.arange(100, 148)[None]
    with torch.inference_mode():
        for s in range(0, 48, 6):
            model(tokens[:, s : s + 6], position_ids=pos[:, s : s + 6], cache=cache)
    store = cache.layers[0].store
    assert torch.equal(store.positions[0, 0], pos[0].int()) and store.positions.dtype == torch.int32
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(tokens, position_ids=pos, cache=ref)
    torch.testing.assert_close(store.read()[0], ref.layers[0].keys, atol=1e-5, rtol=1e-5)


def test_stateful_rope_is_refused(tmp_path):
    model = LlamaForCausalLM(
        LlamaConfig(**ROPE_TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, **ROPE})
    )
    with pytest.raises(ValueError, match="low_rank.keys='pre_rope' cannot work.*dynamic.*keys=post_rope"):
        build_cache(policy(tmp_path, rank=4), model)
    build_cache(policy(tmp_path, rank=4, keys="post_rope"), model)  # post-RoPE needs no inversion


def test_bf16_keeps_float32_bases_and_full_rank_is_exact(tokens, tmp_path):
    model = make_tiny("llama", dtype=torch.bfloat16)
    ref = stream_logits(model, tokens, DynamicCache(config=model.config), chunk=7)
    cache = build_cache(policy(tmp_path, rank=16), model)
    got = stream_logits(model, tokens, cache, chunk=7)
    store = cache.layers[1].store
    assert store.key_basis.dtype == torch.float32 and store.key_coef.dtype == torch.bfloat16
    assert (got.float() - ref.float()).abs().max() < 0.05  # bf16 rounding of the coefficients only
