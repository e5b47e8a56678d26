"""Every decoder family in the zoo: ``full`` is the model's own cache, every policy at a covering budget
is ``full``, windowed layers never see beyond the model's window, unsupported families are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import POLICY_NAMES, small
from helpers import stream_logits
from transformers import DynamicCache
from zoo import REFUSED, SERVED, WINDOW, make_family

from kvcompress import build_cache, make_policy
from kvcompress.core.cache import model_spec

IDS = torch.randint(2, 95, (1, 48), generator=torch.Generator().manual_seed(1))  # 4x the window


def _reference(model, ids, chunk):
    return stream_logits(model, ids, DynamicCache(config=model.config), chunk)


@pytest.mark.parametrize("family", sorted(SERVED))
def test_full_is_the_models_own_cache(family):
    model = make_family(family)
    ref = _reference(model, IDS, 48)
    for chunk in (48, 9, 1):  # one prefill, chunked prefill, token by token far past the window
        got = stream_logits(model, IDS, build_cache("full", model), chunk)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(SERVED))
def test_full_left_padded_batch_generates_as_the_models_own_cache(family):
    model = make_family(family)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 95, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ids[1, :9] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = model.generate(**kw, cache=DynamicCache(config=model.config))
    got = model.generate(**kw, cache=build_cache("full", model))
    assert torch.equal(got, ref)


def _selectors():
    return [n for n in POLICY_NAMES if make_policy(n).selector == n or n in ("quant", "low_rank")]


WINDOWED = sorted(
    f for f in SERVED if f not in ("llama", "qwen3", "gemma", "smollm3", "olmo2", "granite", "glm4")
)
CASES = [(f, "full_attention") for f in sorted(SERVED)] + [(f, "all") for f in WINDOWED]


@pytest.mark.parametrize("family,apply_to", CASES)
def test_every_policy_at_covering_budget_is_full(family, apply_to):
    """Chunked prefill (several queries per forward) and the decode steps of the last chunk."""
    _covering_equals_full(family, apply_to, _selectors(), chunks=(9,))


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_decode_paths_at_covering_budget_are_full_token_by_token(family):
    """The one-query paths (fused decode attention, Quest page reads, in-place eviction) past the window."""
    _covering_equals_full(
        family, "all", ["h2o", "tova", "block_sparse", "block_evict", "sliding_window"], (1,)
    )


def _declared_refusal(name: str, model, apply_to: str, message: str) -> bool:
    """Whether ``message`` is the refusal ``name`` declares for this model: expected attention needs RoPE
    over the whole head; kvzip's context pass scores full-attention layers only (none left, or
    ``apply_to=all`` over windowed layers); duo splits the heads of full-attention layers only."""
    if name == "expected_attention":
        return "RoPE must turn the whole head" in message
    if name == "duo":  # its head split serves full-attention layers only
        spec = model_spec(model)
        windowed = any(spec.window(i) is not None for i in range(spec.num_layers))
        return windowed and apply_to == "all" and "duo.apply_to=all" in message
    if name == "kvzip":
        spec = model_spec(model)
        windowed = [i for i in range(spec.num_layers) if spec.window(i) is not None]
        if windowed and apply_to == "all":
            return "kvzip.apply_to=all" in message and str(windowed) in message
        return len(windowed) == spec.num_layers and "every layer of model" in message
    return False


def _covering_equals_full(family, apply_to, names, chunks):
    model = make_family(family)
    ref = stream_logits(model, IDS, build_cache("full", model), 9)
    for name in names:
        policy = small(name)
        if "apply_to" in {f.name for f in dataclasses.fields(policy)}:
            policy = dataclasses.replace(policy, apply_to=apply_to)
        try:
            build_cache(policy.covering(48), model)
        except ValueError as err:  # only a declared refusal, in its own situation
            assert _declared_refusal(name, model, apply_to, str(err)), err
            continue
        for chunk in chunks:
            got = stream_logits(model, IDS, build_cache(policy.covering(48), model), chunk)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"{family}: {name} ({apply_to})")


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gpt_oss"])
def test_windowed_layers_never_attend_beyond_the_window(family):
    """With ``apply_to: all`` a policy that keeps everything on a windowed layer still reads only the
    model's window: its logits equal the model's, whose sliding layers hold window - 1 tokens."""
    model = make_family(family)
    spec = model_spec(model)
    assert any(spec.window(i) == WINDOW for i in range(spec.num_layers))
    ref = _reference(model, IDS, 1)
    policy = make_policy("sliding_window", window=200, apply_to="all")  # keeps all 48 tokens everywhere
    cache = build_cache(policy, model)
    torch.testing.assert_close(stream_logits(model, IDS, cache, 1), ref, atol=1e-5, rtol=1e-5)
    windowed = [layer for layer in cache.layers if layer.window is not None]
    assert windowed and all(layer.stored_length() == 48 for layer in windowed)  # kept, yet masked


@pytest.mark.parametrize("family", ["mistral", "gemma2", "cohere2"])
def test_default_policy_compresses_only_global_layers_and_counts_window_bytes(family):
    model = make_family(family)
    cache = build_cache(small("h2o"), model)
    stream_logits(model, IDS, cache, 5)
    for layer, s in zip(cache.layers, cache.stats(), strict=True):
        if layer.window is not None:  # the model's own window: window - 1 tokens after each step
            assert s["selector"] == "model_window" and s["tokens_stored"] == WINDOW - 1 and s["bytes"] > 0
            assert s["tokens_evicted"] == 0 and s["model_window_dropped"] == IDS.shape[1] - (WINDOW - 1)
        else:
            assert s["selector"] == "h2o" and s["tokens_stored"] == 12  # h2o's small budget


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_families_are_refused_by_name(family):
    model = make_family(family)
    name = model.config.get_text_config(decoder=True).model_type
    with pytest.raises(ValueError, match=f"model family '{name}' .* is not supported: "):
        build_cache("full", model)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_memory_model_counts_the_models_window(family):
    from kvcompress.memory_model import predicted_for_model

    model = make_family(family)
    for name in ("full", "quant"):
        policy = small(name)
        cache = build_cache(policy, model)
        with torch.inference_mode():
            model(IDS[:, :40], cache=cache, use_cache=True)
            for t in range(40, 48):
                model(IDS[:, t : t + 1], cache=cache, use_cache=True)
        assert cache.memory_bytes() == predicted_for_model(policy, model, 40, decode_tokens=8)


def test_full_on_a_windowed_model_is_not_flagged_as_compressed():
    """The model's own window drops tokens as transformers' cache does: that is not compression."""
    from kvcompress.metrics.compression import tokens_evicted

    model = make_family("mistral")
    cache = build_cache("full", model)
    stream_logits(model, IDS, cache, 5)
    assert tokens_evicted(cache) == 0
    assert sum(s.get("model_window_dropped", 0) for s in cache.stats()) > 0
