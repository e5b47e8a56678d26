"""The C++ kernel for pre-RoPE low-rank logits (``kernels/rope_latent.cpp``) and its shared cos/sin table:
the logits of rebuilding, rotating with the model's own module and multiplying, for every head_dim path,
GQA layout, block of heads and position; the table shared (and counted) once per rotation; the model-module
path where the kernel's pairing is not the model's."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import kernel_or_skip, make_tiny
from helpers import interleaved_rotary, stream_logits
from transformers import LlamaConfig, LlamaForCausalLM
from zoo import ROPE, ROPE_TINY, make_rope_model

from kvcompress import build_cache, kernels
from kvcompress.core.latents import from_blocks
from kvcompress.kernels import fused_low_rank
from kvcompress.metrics.memory import fixed_bytes, shared_bytes
from kvcompress.selectors import LowRankPolicy
from kvcompress.storage import rope_table
from kvcompress.storage.rope import Rope, model_ropes


@pytest.fixture
def _needs_kernel():  # at test time, not collection: the kernels build in the background meanwhile
    kernel_or_skip("rope_latent")


pytestmark = [
    pytest.mark.usefixtures("kernel_isa", "_needs_kernel"),  # the portable twin of every vector loop too
]


def rope_of(head_dim: int) -> Rope:
    """Layer 0's rotation of a tiny random Llama whose heads have ``head_dim`` channels."""
    config = LlamaConfig(
        **{**ROPE_TINY, "head_dim": head_dim}, rope_parameters={"rope_type": "default", **ROPE}
    )
    return model_ropes(LlamaForCausalLM(config).eval(), 3)[0]


def reference(q, coef, decoder, positions, rope):
    """Rebuild every key (B, H_kv, T, D), rotate it with the model's own module, multiply."""
    b, blocks, t, _ = coef.shape
    h_kv = q.shape[1]
    keys = from_blocks(coef @ decoder.mT, h_kv)
    keys = rope.rotate_by_module(keys, positions)  # positions (B, G, T): a block's heads rotate alike
    return fused_low_rank.residual_logits(q, keys, blocks)


@pytest.mark.parametrize(
    "d,h_kv,blocks,n,t",
    [
        (64, 3, 3, 3, 300),
        (64, 3, 1, 3, 37),
        (16, 2, 1, 2, 17),
        (32, 4, 2, 1, 513),
        (96, 2, 1, 2, 33),
        (128, 2, 2, 4, 70),
        (48, 2, 2, 2, 40),
    ],
    ids=["d64-head-gqa3", "d64-joint", "d16-joint", "d32-pairs", "d96-joint", "d128-head", "d48-scalar"],
)
def test_kernel_equals_rebuild_then_rotate(d, h_kv, blocks, n, t):
    rope = rope_of(d)
    gen = torch.Generator().manual_seed(d + t)
    g, r = h_kv // blocks, 5 * (h_kv // blocks)
    q = torch.randn(2, h_kv, n, d, generator=gen)
    store = torch.randn(2, blocks, t + 9, r, generator=gen)  # a growable buffer: the kernel reads a view
    coef = store[:, :, :t]
    decoder = torch.randn(blocks, g * d, r, generator=gen) / r**0.5
    positions = torch.randint(0, 3000, (2, blocks, t), generator=gen, dtype=torch.int32)  # past the table
    assert rope.fits_kernel(d) and rope.table.length < 3000
    got = fused_low_rank.rope_logits(q, (coef,), decoder, positions, rope, seen=t)
    assert rope.table.length >= 3000  # extended to the largest position
    torch.testing.assert_close(got, reference(q, coef, decoder, positions, rope), rtol=1e-4, atol=1e-4)


def test_int8_scales_fold_into_the_logits():
    rope = model_ropes(make_rope_model("llama"), 3)[0]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 2, 16, generator=gen)
    codes = torch.randint(-127, 128, (1, 2, 30, 4), dtype=torch.int8, generator=gen)
    scale = torch.rand(1, 2, 30, 1, generator=gen) / 100
    decoder = torch.randn(2, 16, 4, generator=gen)
    positions = torch.arange(30, dtype=torch.int32).expand(1, 2, 30)
    got = fused_low_rank.rope_logits(q, (codes, scale), decoder, positions, rope, seen=30)
    want = reference(q, codes.float() * scale, decoder, positions, rope)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_negative_position_is_left_to_the_model_module():
    rope = model_ropes(make_rope_model("llama"), 3)[0]
    q, coef = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 4, 3)
    positions = torch.tensor([[[0, 1, -1, 3], [0, 1, 2, 3]]], dtype=torch.int32)
    assert fused_low_rank.rope_logits(q, (coef,), torch.randn(2, 16, 3), positions, rope, seen=4) is None


@pytest.mark.parametrize("family", ["llama", "phi3_partial", "llama3", "yarn"])
def test_the_models_rotations_fit_the_kernel(family):
    """Half-split pairs, partial rotary dims and scaled cos/sin (Llama-3, YaRN's attention factor)."""
    rope = model_ropes(make_rope_model(family), 3)[0]
    assert rope.fits_kernel(16)
    cos, sin = rope.table.covering(40)
    assert cos.shape[-1] == (4 if family == "phi3_partial" else 8)  # rotary dims / 2
    x, pos = torch.randn(1, 1, 40, 16), torch.arange(40, dtype=torch.int32)
    want = rope.rotate_by_module(x, pos.view(1, 1, 40))
    torch.testing.assert_close(rope_table.rotate_halves(x, cos[:40], sin[:40]), want, rtol=1e-5, atol=1e-6)


def test_another_pairing_keeps_the_model_module_path():
    model = make_rope_model("llama")
    mine = model_ropes(model, 3)[0]
    rope = Rope(mine.rotary, interleaved_rotary)
    assert not rope.fits_kernel(16)
    q, coef, dec = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 4, 3), torch.randn(2, 16, 3)
    pos = torch.arange(4, dtype=torch.int32).expand(1, 2, 4)
    assert fused_low_rank.rope_logits(q, (coef,), dec, pos, rope, seen=4) is None


def policy(tmp_path, **kw):
    base = {"rank": 4, "calibration_text": "random", "calibration_tokens": 64}
    base["calibration_dir"] = str(tmp_path)
    return LowRankPolicy(**{**base, **kw})


@pytest.mark.parametrize("basis", ["joint", "head"])
def test_decode_uses_the_kernel_with_the_logits_of_the_model_module(basis, tokens, tmp_path, monkeypatch):
    model = make_tiny("llama")
    out, steps = {}, {}
    for path in ("kernel", "module"):
        if path == "module":
            monkeypatch.setattr(kernels, "load", lambda kernel="": None)
        cache = build_cache(policy(tmp_path, basis=basis, recent=2), model)
        out[path] = stream_logits(model, tokens, cache, chunk=1)
        steps[path] = [s["rope_kernel_steps"] for s in cache.stats()]
        for layer in cache.layers:  # the key decoder is stored as the kernel reads it: no copy per step
            dec = layer.store.decoder["keys"]
            assert dec.mT.is_contiguous() and dec.mT.contiguous().data_ptr() == dec.data_ptr()
    assert steps["kernel"] == [48 - 3] * 3 and steps["module"] == [0] * 3  # every step with encoded keys
    torch.testing.assert_close(out["kernel"], out["module"], rtol=1e-5, atol=1e-5)


def test_the_table_is_shared_by_the_layers_and_reported_apart_from_the_cache(tokens, tmp_path):
    """One table for the model's rotation: not a cached token's bytes, so not in ``memory_bytes``, and
    reported in every layer's stats; a snapshot shares it."""
    model = make_tiny("llama")
    cache = build_cache(policy(tmp_path), model)
    stream_logits(model, tokens, cache, chunk=1)
    assert len({id(layer.store.rope.table) for layer in cache.layers}) == 1
    table = cache.layers[0].store.rope.table
    assert table.length == rope_table.STEP
    table_bytes = 4 * table.cos.numel() * 4  # cos and sin and their inverse rows (encoding), float32
    assert [s["rope_table_bytes"] for s in cache.stats()] == [table_bytes] * 3
    assert shared_bytes(cache) == table_bytes  # once for the three layers sharing it
    held = [t for layer in cache.layers for t in layer.tensors()]
    assert not {t.untyped_storage().data_ptr() for t in table.tensors()} & {
        t.untyped_storage().data_ptr() for t in held if t is not None
    }
    snap = copy.deepcopy(cache)
    assert snap.layers[0].store.rope is cache.layers[0].store.rope  # a constant: shared, not copied
    assert snap.memory_bytes() == cache.memory_bytes() and fixed_bytes(snap) == fixed_bytes(cache)
    assert shared_bytes(snap) == table_bytes


@pytest.mark.parametrize("family", ["llama", "phi3_partial", "yarn"])
def test_rotations_read_from_the_table_equal_the_models_module(family):
    """``rotate``/``unrotate`` take cos/sin rows from the table where it holds the positions (the same
    products and sums as the model's function), the module past it or for a negative position."""
    rope = model_ropes(make_rope_model(family), 3)[0]
    x = torch.randn(2, 2, 9, 16, generator=torch.Generator().manual_seed(4))
    inside = torch.randint(0, 1000, (2, 1, 9), dtype=torch.int32)
    for pos in (inside, inside + 5000, torch.where(inside > 500, -3, inside)):
        want = rope.rotate_by_module(x, pos)
        assert torch.equal(rope.rotate(x, pos), want)
        torch.testing.assert_close(rope.unrotate(want, pos), x, rtol=1e-5, atol=1e-5)
    assert rope._rows(inside, 16, inverse=False) is not None and rope._rows(inside + 5000, 16, True) is None


@pytest.mark.parametrize("d", [16, 64, 96])
def test_keys_turned_by_the_kernel_have_the_tensor_forms_bits(d):
    """Encoding un-rotates each key with ``turn_keys``: the bits of ``rotate_halves`` on the table's rows
    (vector and scalar channels), both directions, a block's heads sharing their row's positions."""
    rope = rope_of(d)
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(2, 4, 5, d, generator=gen) * 10
    pos = torch.randint(0, 1000, (2, 2, 5), generator=gen, dtype=torch.int32)
    for inverse in (False, True):
        got = rope._by_kernel(x, pos, inverse)
        assert got is not None and torch.equal(got, rope._apply(x, *rope._rows(pos, d, inverse), halves=True))
    assert rope._by_kernel(x, pos + 5000, False) is None  # past the table: the model's module then


@pytest.mark.parametrize("d", [16, 48, 64, 128])
def test_the_kernels_rotation_has_the_tensor_forms_bits(d):
    """Keys rebuilt exactly (one component of 1.0 times a decoder row) and read channel by channel (one-hot
    queries): the logits are the rotated keys themselves, bit for bit those of ``rotate_halves`` on the
    table's rows, on every path (rotated in registers at D = 64 and 128, after the rebuild otherwise)."""
    rope = rope_of(d)
    gen = torch.Generator().manual_seed(d)
    blocks, t = 2, 37
    keys = torch.randn(blocks, d, generator=gen) * 10  # one key per KV head, at t positions
    positions = torch.randint(0, 1000, (1, blocks, t), generator=gen, dtype=torch.int32)
    q = torch.eye(d).expand(1, blocks, d, d).contiguous()  # (B, H_kv, n = D, D): channel j of each key
    got = fused_low_rank.rope_logits(q, (torch.ones(1, blocks, t, 1),), keys[..., None], positions, rope, t)
    cos, sin = rope.table.covering(1)
    pos = positions[0].long()  # (blocks, t)
    want = rope_table.rotate_halves(keys[:, None].expand(-1, t, -1), cos[pos], sin[pos])  # (blocks, t, D)
    assert got is not None and torch.equal(got[0].mT, want)
