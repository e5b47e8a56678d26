"""The quant policy layer: residual boundary, packed storage and its bytes, validation, mixed precision."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import held_tensors, stream_logits

from kvcompress import build_cache, make_policy
from kvcompress.selectors import FullPolicy, ModelSpec, QuantPolicy
from kvcompress.storage.quant import quantizer as Q


def spy_keys(layer):
    """Record the keys each ``update`` receives and returns."""
    received, returned = [], []
    orig = layer.update

    def spy(k, v, *a, **kw):
        received.append(k.clone())
        out = orig(k, v, *a, **kw)
        returned.append(out[0])
        return out

    layer.update = spy
    return received, returned


@pytest.mark.parametrize("residual,group", [(5, 4), (0, 4), (8, 8), (3, 1)])
def test_residual_boundary_and_group_alignment_are_exact(llama, tokens, residual, group):
    cache = build_cache(
        "quant", llama, bits=4, group_size=group, recent=residual, backend="dense"
    )  # "dense": update returns the dense copy this test inspects
    layer = cache.layers[0]
    received, returned = spy_keys(layer)
    for t in range(1, tokens.shape[1] + 1):
        stream_logits(llama, tokens[:, t - 1 : t], cache, chunk=1)
        expected = max(0, (t - residual) // group * group)
        assert (layer.store.encoded_length, layer.stored_length()) == (expected, t)
    keys = torch.cat(received, dim=-2)  # (1, H_kv, 48, D), as the model produced them
    tq = layer.store.encoded_length
    # groups are aligned to token 0: quantizing all quantized tokens at once gives the same codes
    ref = Q.quantize(keys[:, :, :tq], 4, group, "channel", torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(layer.store.qkeys, ref, strict=True))
    # the newest tokens are returned untouched; quantized ones only approximately
    last = returned[-1]
    assert torch.equal(last[:, :, tq:], keys[:, :, tq:]) and last.shape[-2] - tq >= residual
    if tq:
        err = (last[:, :, :tq] - keys[:, :, :tq]).abs()
        assert 0 < err.max() <= ref.scale.float().max() / 2


@pytest.mark.parametrize("bits,group,expected", [(8, 32, 9.0), (4, 32, 5.0), (2, 64, 2.5), (8, 64, 8.5)])
def test_bits_per_element_and_every_byte_counted(bits, group, expected):
    model = make_tiny("llama")
    model.config.head_dim = 64  # a token-axis group of 64 needs head_dim 64: rebuild with it
    model = type(model)(model.config).eval()
    ids = torch.randint(2, 95, (1, 150))
    cache = build_cache("quant", model, bits=bits, group_size=group, recent=10)
    stream_logits(model, ids, cache, chunk=37)
    for s, layer in zip(cache.stats(), cache.layers, strict=True):
        assert s["bits_per_quantized_element"] == pytest.approx(expected)
        assert s["quantized_tokens"] == (150 - 10) // group * group
        assert s["residual_tokens"] == 150 - s["quantized_tokens"]
        assert s["bytes"] == s["code_bytes"] + s["scale_zero_bytes"] + s["residual_bytes"]
        assert s["code_bytes"] == 2 * 2 * s["quantized_tokens"] * 64 * bits // 8  # K and V, 2 KV heads
        assert layer.store.qkeys.codes.dtype == torch.uint8 and layer.store.qkeys.scale.dtype == torch.float16


def test_no_float_copy_of_quantized_tokens_is_held(llama, tokens):
    cache = build_cache("quant", llama, bits=2, group_size=4, recent=6)
    stream_logits(llama, tokens, cache, chunk=1)
    for layer in cache.layers:
        residual = layer.stored_length() - layer.store.encoded_length
        floats = [t for t in held_tensors(layer) if t.dtype == torch.float32]
        assert floats and all(t.shape[-2] == residual for t in floats)  # only the residual window
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * 4  # flushed storage freed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_stay_finite(dtype, tokens):
    model = make_tiny("qwen2", dtype=dtype)
    cache = build_cache("quant", model, bits=2, group_size=4, recent=0)
    logits = stream_logits(model, tokens, cache, chunk=3)
    assert torch.isfinite(logits).all()
    layer = cache.layers[1]
    assert layer.store.qkeys.scale.dtype == dtype and layer.keys.dtype == dtype


def test_beam_reorder_moves_every_part(llama):
    ids = torch.randint(2, 95, (2, 20))
    cache = build_cache("quant", llama, bits=4, group_size=4, recent=3)
    stream_logits(llama, ids, cache, chunk=20)
    layer = cache.layers[0]
    before = [t.clone() for t in (*layer.store.qkeys, *layer.store.qvalues, layer.keys, layer.values)]
    cache.reorder_cache(torch.tensor([1, 1]))
    after = (*layer.store.qkeys, *layer.store.qvalues, layer.keys, layer.values)
    assert all(torch.equal(a, b[[1, 1]]) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize(
    "field,value",
    [("bits", 3), ("group_size", 0), ("recent", -1), ("key_axis", "rows"), ("scale_dtype", "int8")],
)
def test_bad_fields_are_rejected_with_the_field_name(field, value):
    with pytest.raises(ValueError, match=f"quant.{field}={value!r}"):
        QuantPolicy(**{field: value})


def test_group_must_divide_head_dim_on_the_token_axis():
    spec = ModelSpec(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=64)
    with pytest.raises(
        ValueError, match="group_size=12 must divide head_dim=16.*allowed: \\[1, 2, 4, 8, 16\\]"
    ):
        QuantPolicy(group_size=12).check(spec)
    QuantPolicy(group_size=12, value_axis="channel").check(spec)  # tokens can be grouped by any G


def test_mixed_precision_schedule_assigns_full_int8_int4():
    layers = make_policy("mixed_precision").assignment(30)
    kinds = [p.bits if isinstance(p, QuantPolicy) else "full" for p in layers]
    assert kinds == ["full"] * 2 + [8] * 18 + [4] * 10
    assert type(layers[2]) is not FullPolicy and layers[2].storage.name == "quant"
    assert layers[29].group_size == 32


def test_mixed_precision_cache_stores_each_layer_at_its_precision(llama, tokens):
    sched = make_policy(
        "mixed_precision",
        default={
            "_target_": "kvcompress.selectors.QuantPolicy",
            "bits": 8,
            "group_size": 4,
            "recent": 4,
        },
        rules=[
            {"layers": "0", "policy": {"_target_": "kvcompress.selectors.FullPolicy"}},
            {"layers": "-1:", "policy": QuantPolicy(bits=2, group_size=4, recent=4)},
        ],
    )
    cache = build_cache(sched, llama)
    stream_logits(llama, tokens, cache, chunk=8)
    stats = cache.stats()
    assert [s.get("bits") for s in stats] == [None, 8, 2]
    assert stats[0]["bytes"] > stats[1]["bytes"] > stats[2]["bytes"]
    assert cache.memory_bytes() == sum(s["bytes"] for s in stats)


QUANT_CHANNEL = {"name": "quant", "bits": 4, "group_size": 4, "recent": 4, "key_axis": "channel"}


def _count_encoded(cache) -> list[int]:
    """Per layer, the tokens its quant store encodes, summed over every ``encode`` call."""
    counts = [0] * len(cache.layers)
    for i, layer in enumerate(cache.layers):
        store, encode = layer.store, layer.store.encode

        def counted(kind, x, *args, _i=i, _encode=encode, **kwargs):
            counts[_i] += x.shape[2] if kind == "keys" else 0
            return _encode(kind, x, *args, **kwargs)

        store.encode = counted
    return counts


@pytest.mark.parametrize(
    "selector,params",
    [
        ("snapkv", {"budget": 16, "observation_window": 4, "slack": None}),
        ("expected_attention", {"budget": 16, "compression_ratio": None}),
        ("kvzip", {"budget": 16, "compression_ratio": None, "context_chunk": 8}),
    ],
)
def test_prefill_eviction_over_channel_groups_quantizes_each_token_once(llama, tokens, selector, params):
    """A chunked prompt evicted at every chunk, then decode: no token is quantized twice (the prompt stays
    exact while it may be evicted; it used to be dequantized and quantized again at every chunk)."""
    from kvcompress.runtime.context_pass import compress_context

    cache = build_cache(selector, llama, storage=QUANT_CHANNEL, **params)
    encoded = _count_encoded(cache)
    prompt = tokens[:, :36]
    stream_logits(llama, prompt, cache, 12)  # three multi-token steps
    if selector == "kvzip":
        compress_context(llama, cache, prompt)
    stream_logits(llama, tokens[:, 36:], cache, 1)  # decode steps: the kept prompt is quantized now
    for count, layer in zip(encoded, cache.layers, strict=True):
        assert layer.store.encoded_length > 0 and layer.evicted > 0
        assert count == layer.store.encoded_length  # every quantized token encoded exactly once


def test_an_eviction_into_quantized_channel_groups_is_refused_by_name(llama, tokens):
    """After decode steps quantized the prompt, a second multi-token forward that evicts would have to
    quantize per-channel groups again: refused, naming the axis; per-token groups evict exactly."""
    policy = {"budget": 12, "observation_window": 2, "slack": None}
    for axis in ("channel", "token"):
        cache = build_cache("snapkv", llama, storage={**QUANT_CHANNEL, "key_axis": axis}, **policy)
        stream_logits(llama, tokens[:, :24], cache, 24)
        stream_logits(llama, tokens[:, 24:32], cache, 1)
        assert cache.layers[0].store.encoded_length > 0
        if axis == "channel":
            with pytest.raises(ValueError, match=r"key_axis='channel'.*refused.*key_axis=token"):
                stream_logits(llama, tokens[:, 32:], cache, 16)
        else:
            stream_logits(llama, tokens[:, 32:], cache, 16)
            assert cache.layers[0].stored_length() <= 12 + 16
