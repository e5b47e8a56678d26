"""Rotated quantization with a key sketch (turboquant): the rotation, the sketch, the store and its bytes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny
from helpers import stream_logits

from kvcompress import build_cache
from kvcompress.core import rotation as rot
from kvcompress.core.cache import model_spec
from kvcompress.core.spec import ModelSpec, Shape
from kvcompress.metrics.compression import attention_backends
from kvcompress.storage.quant import quantizer
from kvcompress.storage.quant.turbo import TurboStorage


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("dim", [8, 64, 48])
def test_the_rotation_is_orthogonal_and_undone_exactly(dim):
    turn = rot.random_rotation(dim, seed=3)
    eye = torch.eye(dim)
    matrix = turn.forward(eye).double()  # row i: basis vector i turned
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(dim, dtype=torch.float64), atol=1e-6, rtol=0)
    x = torch.randn(5, 7, dim, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(turn.inverse(turn.forward(x)), x, atol=1e-5, rtol=0)
    if rot.is_power_of_two(dim):  # the randomized Hadamard transform, against the float64 Sylvester matrix
        want = (x.double() * turn.signs.double()) @ _sylvester(dim) / math.sqrt(dim)
        torch.testing.assert_close(turn.forward(x).double(), want, atol=1e-5, rtol=0)
        assert turn.matrix is None and turn.signs.abs().eq(1).all()
    else:
        assert turn.signs is None and turn.matrix.shape == (dim, dim)


def test_the_signs_pack_eight_to_a_byte_and_back():
    positive = torch.rand(3, 4, 24, generator=torch.Generator().manual_seed(1)) > 0.5
    packed = rot.pack_signs(positive)
    assert packed.shape == (3, 4, 3) and packed.dtype == torch.uint8
    assert torch.equal(rot.unpack_signs(packed), positive.float() * 2 - 1)


def test_the_sketch_estimates_a_residuals_product_without_bias_over_seeds():
    gen = torch.Generator().manual_seed(0)
    q, r = (
        torch.randn(32, generator=gen, dtype=torch.float64),
        torch.randn(32, generator=gen, dtype=torch.float64),
    )
    want = float(q @ r)
    got = []
    for seed in range(3000):
        proj = rot.projection(32, 32, seed)
        signs, norm = rot.sketch(r.float(), proj)
        got.append(float(rot.estimate(signs, norm, proj).double() @ q))
    got = torch.tensor(got, dtype=torch.float64)
    error = got.std() / math.sqrt(len(got))
    assert abs(float(got.mean()) - want) < 4 * error  # unbiased
    assert float(got.std()) > 0.05 * abs(want)  # one seed alone is an estimate, not the product
    # the logits form equals the estimate's product
    proj = rot.projection(32, 32, 0)
    signs, norm = rot.sketch(r.float()[None, None, None], proj)
    logit = rot.sketch_logits(q.float()[None, None, None], signs, norm, proj)
    torch.testing.assert_close(logit[0, 0, 0, 0].double(), got[0], atol=1e-4, rtol=1e-4)


def test_rotating_first_shrinks_the_error_an_outlier_channel_causes():
    """One scale per token: an outlier channel stretches it for every other channel, unless the rotation
    spreads it first."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 64, 64, generator=gen)
    x[..., 5] *= 40  # the outlier channel keys are known for
    plain = quantizer.quantize(x, 4, 64, "token", torch.float32)
    plain_err = (quantizer.dequantize(plain, 4, 64, "token", torch.empty_like(x)) - x).pow(2).mean()
    turn = rot.random_rotation(64, seed=0)
    codes = quantizer.quantize(turn.forward(x), 4, 64, "token", torch.float32)
    back = turn.inverse(quantizer.dequantize(codes, 4, 64, "token", torch.empty_like(x)))
    assert (back - x).pow(2).mean() < 0.5 * plain_err


def _run(model, ids, **kw):
    cache = build_cache("turboquant", model, **kw)
    with torch.inference_mode():
        model(ids[:, :16], cache=cache)
        logits = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(16, ids.shape[1])], 1)
    return logits, cache


@pytest.mark.parametrize("sketch", [True, False])
def test_attention_from_the_codes_equals_the_rotated_back_read(sketch):
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 36), generator=torch.Generator().manual_seed(4))
    dense, c_dense = _run(model, ids, recent=4, sketch=sketch, backend="dense")
    assert set(attention_backends(c_dense)) == {"sdpa"}
    for backend in ("torch", "cpu"):
        codes, cache = _run(model, ids, recent=4, sketch=sketch, backend=backend)
        assert attention_backends(cache)[backend] == 20 * len(cache.layers)  # every decode step from codes
        torch.testing.assert_close(codes, dense, atol=2e-5, rtol=1e-4)


def _logit_error(**fields) -> float:
    """Mean squared error of the logits of 64 Gaussian queries over 256 Gaussian keys read back from a store
    (head_dim 32, 2-bit codes, no exact window)."""
    spec = ModelSpec(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=32, max_positions=512)
    gen = torch.Generator().manual_seed(0)
    keys, queries = torch.randn(1, 1, 256, 32, generator=gen), torch.randn(64, 32, generator=gen)
    errors = []
    for seed in range(4):
        store = TurboStorage(bits=2, recent=0, seed=seed, **fields).layer(0, spec)
        store.append(keys, keys)
        store.flush()
        read = store.read()[0][0, 0]
        errors.append(float((queries @ (read - keys[0, 0]).T).pow(2).mean()))
    return sum(errors) / len(errors)


def test_the_sketch_trades_bias_for_variance_as_its_width_says():
    """Without the sketch a logit misses ``q . r``; with it the miss is the estimate's variance, about
    ``pi / 2 / m`` of ``|q|^2 |r|^2`` against ``1 / D`` (head_dim D): a sketch narrower than ``pi / 2 * D``
    signs adds error, a wider one removes it."""
    plain = _logit_error(sketch=False)
    assert _logit_error(sketch=True, sketch_dim=128) < 0.6 * plain  # 4 D signs: about 0.39 of the error
    assert _logit_error(sketch=True, sketch_dim=16) > 1.5 * plain  # D / 2 signs: about 3.1 times
    assert _logit_error(sketch=True) < 0.9 * plain  # the default, 2 D signs: about 0.77


def test_the_sketch_costs_its_bytes():
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 48), generator=torch.Generator().manual_seed(5))
    sizes = {}
    for sketch in (False, True):
        cache = build_cache("turboquant", model, bits=2, recent=0, sketch=sketch)
        stream_logits(model, ids, cache, chunk=1)
        sizes[sketch] = cache.memory_bytes()
    spec = model_spec(model)
    d, layers, kv = spec.head_dim, spec.num_layers, spec.num_kv_heads
    per_token = 2 * d // 8 + 2  # 2 d sign bits and a float16 norm per key
    assert sizes[True] - sizes[False] == layers * (kv * 48 * per_token + 4 * 2 * d * d)  # and the projection


def test_each_encoded_token_holds_packed_codes_and_exactly_its_bytes():
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 30), generator=torch.Generator().manual_seed(6))
    cache = build_cache("turboquant", model, bits=4, recent=6, sketch=True)
    stream_logits(model, ids, cache, chunk=1)
    store, spec = cache.layers[0].store, model_spec(model)
    d = spec.head_dim
    keys, values = store.encoded["keys"], store.encoded["values"]
    assert store.encoded_length == 24 and store.residual_length == 6
    assert keys.codes.dtype == torch.uint8 and keys.codes.shape[-1] == d // 2
    assert keys.signs.shape[-1] == 2 * d // 8 and keys.norm.dtype == torch.float16
    assert len(values) == 3  # values carry no sketch
    config = TurboStorage(bits=4, recent=6, sketch=True)
    assert (
        config.token_bytes(Shape(1, spec.num_kv_heads, spec.num_heads, d, 4, 30, 0), "keys")
        == d // 2 + 4 + 2 * d // 8 + 2
    )


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"group_size": 5}, ["turboquant.group_size=5", "allowed"]),
        ({"sketch": True, "sketch_dim": 12}, ["turboquant.sketch_dim=12", "multiple of 8"]),
        ({"bits": 3}, ["bits", "3"]),
    ],
)
def test_bad_settings_are_refused_by_name(fields, words):
    model = make_tiny("llama")
    with pytest.raises(ValueError) as err:
        build_cache("turboquant", model, **fields)
    assert all(w in str(err.value) for w in words)
