"""Group quantization primitives: exact packing, error within scale/2, the two grouping axes, safety."""

from __future__ import annotations

import pytest
import torch

from kvcompress.storage.quant import quantizer as Q

SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def roundtrip(x, bits, group, axis, scale_dtype=torch.float16, valid=None):
    q = Q.quantize(x, bits, group, axis, scale_dtype, valid)
    out = torch.full((*x.shape[:2], x.shape[2] + 3, x.shape[3]), float("nan"), dtype=x.dtype)
    Q.dequantize(q, bits, group, axis, out[:, :, : x.shape[2]])  # a strided slice, as the layer does
    assert out[:, :, x.shape[2] :].isnan().all()  # wrote only its slice
    return q, out[:, :, : x.shape[2]]


def per_element(t, group, axis):
    """Scale/zero (B, H, groups...) broadcast back to (B, H, T, D)."""
    return t.float().repeat_interleave(group, 2 if axis == "channel" else 3)


@pytest.mark.parametrize("bits", Q.BITS)
def test_packing_roundtrips_every_code_exactly(bits):
    codes = torch.arange(1 << bits, dtype=torch.uint8).repeat(2, 3, 4, 16 // (1 << bits) or 1, 1)
    codes = codes.reshape(2, 3, -1, 16)[..., torch.randperm(16)]
    packed = Q.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*codes.shape[:-1], 16 * bits // 8)
    assert torch.equal(Q.unpack(packed, bits), codes)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("axis", Q.AXES)
@pytest.mark.parametrize("bits", Q.BITS)
def test_error_is_at_most_half_a_scale(bits, axis, scale_dtype):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 16, 32, generator=g) * 4 + torch.randn(1, 1, 1, 32, generator=g) * 10
    q, y = roundtrip(x, bits, 8, axis, scale_dtype)
    assert q.scale.dtype == q.zero.dtype == scale_dtype
    scale = per_element(q.scale, 8, axis)
    assert ((x - y).abs() <= scale / 2 * (1 + 1e-5) + 1e-6).all()
    codes = Q.unpack(q.codes, bits)
    assert codes.max() == (1 << bits) - 1 and codes.min() == 0  # the range is used, not wasted


def test_channel_axis_isolates_an_outlier_channel_token_axis_does_not():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 32, 16, generator=g) * 0.1  # (B, H, T, D)
    x[..., 5] += 50.0  # one outlier channel, as keys have
    (qc, yc), (qt, yt) = roundtrip(x, 4, 16, "channel"), roundtrip(x, 4, 16, "token")
    assert qc.scale.shape == (1, 2, 2, 16) and qt.scale.shape == (1, 2, 32, 1)
    normal = torch.arange(16) != 5
    # per channel: a normal channel's scale follows its own range over 16 tokens, not the outlier's
    span = x.view(1, 2, 2, 16, 16).amax(3) - x.view(1, 2, 2, 16, 16).amin(3)  # (B, H, T/G, D)
    assert (qc.scale.float()[..., normal] <= span[..., normal] / 15 * 1.01).all()
    # per token: the outlier sets every token's scale, so normal channels lose all their detail
    assert (qt.scale.float() >= 49.0 / 15).all()
    err_c, err_t = (x - yc)[..., normal].abs().max(), (x - yt)[..., normal].abs().max()
    assert err_c < 0.05 < err_t


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("axis", Q.AXES)
def test_constant_groups_and_zeros_are_exact_enough_and_finite(axis, scale_dtype):
    x = torch.zeros(1, 1, 8, 8)
    x[..., 4:, :] = 0.1  # constant groups on both axes (max == min)
    q, y = roundtrip(x, 2, 4, axis, scale_dtype)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert torch.equal(y[..., :4, :], x[..., :4, :])  # zeros come back exactly
    assert (y - x).abs().max() <= per_element(q.scale, 4, axis).max() / 2


@pytest.mark.parametrize("axis", Q.AXES)
def test_large_outliers_stay_finite_and_bounded(axis):
    x = torch.randn(1, 1, 8, 8)
    x[0, 0, 3, 2], x[0, 0, 6, 7] = 4e4, -1e6
    _, y = roundtrip(x, 4, 4, axis, torch.bfloat16)  # bfloat16 scales hold any float32 range
    assert torch.isfinite(y).all() and (x - y).abs().max() <= 1e6 / 15 / 2 * 1.01
    _, y16 = roundtrip(x, 4, 4, axis, torch.float16)  # float16 scales saturate beyond 65504
    assert torch.isfinite(y16).all() and y16.min() >= -65504


@pytest.mark.parametrize("dtype,top", [(torch.float16, 65504.0), (torch.bfloat16, 1e38)])
def test_half_precision_inputs_near_the_edge_of_their_range(dtype, top):
    x = torch.tensor([-top, top, 0.0, 1.0] * 4, dtype=dtype).view(1, 1, 2, 8)
    q, y = roundtrip(x, 2, 8, "token", dtype)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert y[0, 0, :, 0].eq(x[0, 0, :, 0]).all()  # the group minimum is the zero point
    assert ((y - x).float().abs() <= per_element(q.scale, 8, "token") / 2 * 1.01).all()


def test_padding_tokens_do_not_widen_channel_groups():
    x = torch.randn(1, 1, 8, 4)
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    valid[..., :3] = False
    padded = x.clone()
    padded[..., :3, :] = 1e5  # what a padding token's key may look like
    q_pad = Q.quantize(padded, 4, 4, "channel", torch.float16, valid)
    ref = x.clone()
    ref[..., :3, :] = x[..., 3:4, :]  # the same group with only real values
    q_ref = Q.quantize(ref, 4, 4, "channel", torch.float16)
    assert torch.equal(q_pad.scale, q_ref.scale) and torch.equal(q_pad.zero, q_ref.zero)
