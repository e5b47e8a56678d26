"""The model's own rotary embedding, to turn cached keys to pre-RoPE and back (``kvcompress.storage.rope``),
and the cos/sin table by position that its layers share (``kvcompress.storage.rope_table``): turning keys
equals RoPE's formula and the model's own keys, the inverse turn recovers them, each block of heads turns at
its own positions, the table grows by whole steps and serves exactly the module's numbers; refusals named."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny
from helpers import interleaved_rotary
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from zoo import ROPE, ROPE_TINY, make_family, make_rope_model

from kvcompress.core import kernel_slots
from kvcompress.storage import rope_table
from kvcompress.storage.rope import Rope, model_ropes
from kvcompress.storage.rope_table import STEP, RopeTable

FAMILIES = ["llama", "qwen2", "phi3_partial", "llama3", "yarn", "smollm3_nope"]
D = 16  # the tiny models' head_dim


@pytest.fixture
def no_kernel(monkeypatch):
    """No C++ ``turn_keys`` lent: ``rotate`` / ``unrotate`` run their tensor forms."""
    monkeypatch.setitem(kernel_slots._LENT, "turn_keys", [])


def formula(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE written out (RoFormer, rotate-half pairing): x (..., n, D) at positions (..., n)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # (D / 2,)
    angle = positions.float()[..., None] * inv_freq  # (..., n, D / 2)
    cos, sin = angle.cos().repeat(1, 1, 1, 2), angle.sin().repeat(1, 1, 1, 2)
    half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1)
    return x * cos + half * sin


@pytest.mark.parametrize("path", ["table", "module"])
def test_rotating_keys_is_ropes_formula(no_kernel, path):
    rope = model_ropes(make_tiny("llama"), 3)[0]
    x = torch.randn(2, 2, 9, D, generator=torch.Generator().manual_seed(0))
    pos = torch.randint(0, 900, (2, 1, 9), generator=torch.Generator().manual_seed(1))
    if path == "module":
        pos = pos + 5000  # past the table's rows: the model's rotary module is asked
    got = rope.rotate(x, pos)
    assert got.dtype == torch.float32 and rope.table.length == STEP  # the table was made, but not grown
    torch.testing.assert_close(got, formula(x, pos.expand(2, 2, 9)), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_unrotate_then_rotate_is_identity(family):
    rope = model_ropes(make_rope_model(family), 3)[0]
    x = torch.randn(2, 2, 9, 16)
    pos = torch.randint(0, 500, (2, 2, 9))
    torch.testing.assert_close(rope.rotate(rope.unrotate(x, pos), pos), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(rope.unrotate(rope.rotate(x, pos), pos), x, atol=1e-5, rtol=0)


def _pre_and_post(model, tokens):
    """Keys of layer 0 as projected (pre-RoPE, k_norm included) and as the cache received them."""
    seen = {}
    attn = model.model.layers[0].self_attn
    proj = getattr(attn, "k_proj", None) or attn.qkv_proj
    hook = proj.register_forward_hook(lambda m, i, o: seen.setdefault("proj", o))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(tokens, cache=cache)
    hook.remove()
    return seen["proj"], cache.layers[0].keys


@pytest.mark.parametrize("family", ["llama", "phi3_partial", "llama3", "yarn"])
def test_rope_is_the_models_own_rotation(family, tokens):
    model = make_rope_model(family)
    proj, post = _pre_and_post(model, tokens[:, :20])
    d, h = 16, 2
    if family == "phi3_partial":  # fused qkv: the keys follow the 4 query heads
        proj = proj[..., 4 * d : 6 * d]
    pre = proj.view(1, 20, h, d).transpose(1, 2)  # (1, H_kv, T, D)
    pos = torch.arange(20).expand(1, h, 20)
    rope = model_ropes(model, 3)[0]
    torch.testing.assert_close(rope.rotate(pre, pos), post, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope.unrotate(post, pos), pre, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "phi3_partial", "yarn"])
def test_the_tables_rows_give_the_modules_bits_and_the_module_serves_past_them(no_kernel, family):
    """The table path (tensor form on a CPU) has the same products and sums as the model's function; a
    position past the table or a negative one goes to the module, with the same result."""
    rope = model_ropes(make_rope_model(family), 3)[0]
    x = torch.randn(2, 2, 9, D, generator=torch.Generator().manual_seed(4))
    inside = torch.randint(0, 1000, (2, 1, 9), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    for pos in (inside, inside + 5000, torch.where(inside > 500, -3, inside)):
        want = rope.rotate_by_module(x, pos)
        assert torch.equal(rope.rotate(x, pos), want)
        torch.testing.assert_close(rope.unrotate(want, pos), x, rtol=1e-5, atol=1e-5)
    assert rope._rows(inside, D, inverse=False) is not None
    assert rope._rows(inside + 5000, D, inverse=True) is None
    assert rope.table.length == STEP  # a rotation past the table does not grow it (the decode kernel does)


def test_each_block_of_heads_turns_at_its_own_rows_positions(no_kernel):
    """positions (B, h, n) with h dividing H_kv: row j serves the H_kv / h consecutive heads of block j."""
    rope = model_ropes(make_tiny("llama"), 3)[0]
    x = torch.randn(1, 4, 5, D, generator=torch.Generator().manual_seed(6))
    pos = torch.tensor([[[0, 1, 2, 3, 4], [100, 7, 300, 9, 2000]]])  # (1, 2, 5): heads 0-1, heads 2-3
    got = rope.rotate(x, pos)
    for head in range(4):
        alone = rope.rotate(x[:, head : head + 1], pos[:, head // 2 : head // 2 + 1])
        assert torch.equal(got[:, head : head + 1], alone)
    want = formula(x[:, 2:], pos[:, 1:].expand(1, 2, 5))
    torch.testing.assert_close(got[:, 2:], want, atol=1e-4, rtol=1e-5)


def test_layers_share_one_table_and_a_copy_of_the_rotation_is_the_rotation():
    ropes = model_ropes(make_tiny("llama"), 3)
    assert len(ropes) == 3 and all(isinstance(r, Rope) for r in ropes)
    assert len({id(r.table) for r in ropes}) == 1 and ropes[0].layer_type is None
    assert copy.deepcopy(ropes[1]) is ropes[1]  # a constant shared by a cache and its snapshots


def test_gemma3_local_and_global_layers_keep_their_own_tables():
    model = make_family("gemma3")  # tiny Gemma 3: sliding and full attention layers, two rotations
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    ropes = model_ropes(model, n)
    by_type = {}
    for rope in ropes:
        by_type.setdefault(rope.layer_type, set()).add(id(rope.table))
    assert len(by_type) == 2 and all(len(ids) == 1 for ids in by_type.values())
    local, full = (next(r for r in ropes if r.layer_type == t) for t in sorted(by_type))
    assert not torch.equal(local.table.covering(64)[0], full.table.covering(64)[0])


def test_nope_layers_have_no_rotation():
    assert [r is None for r in model_ropes(make_rope_model("smollm3_nope"), 3)] == [False, True, False]


def test_rotations_that_cannot_be_inverted_are_refused_by_name():
    dynamic = {"rope_type": "dynamic", "factor": 2.0, **ROPE}
    with pytest.raises(ValueError, match=r"llama: rope_type='dynamic' changes its frequencies"):
        model_ropes(LlamaForCausalLM(LlamaConfig(**ROPE_TINY, rope_parameters=dynamic)), 3)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=96, n_positions=32))
    with pytest.raises(ValueError, match="gpt2: no rotary embedding module found"):
        model_ropes(gpt2, 1)


def test_the_table_grows_by_whole_steps_and_at_least_an_eighth():
    asked = []
    rope = model_ropes(make_tiny("llama"), 3)[0]
    table = RopeTable(lambda p: asked.append(p.shape[-1]) or rope._cos_sin(p))
    assert table.length == 0 and table.tensors() == []
    cos, sin = table.covering(5)
    assert table.length == STEP and cos.shape == sin.shape == (STEP, D // 2) and cos.dtype == torch.float32
    assert table.covering(STEP) == (cos, sin) and asked == [STEP]  # covered: nothing recomputed
    for stop, length in [(STEP + 1, 2 * STEP), (8 * STEP, 8 * STEP), (8 * STEP + 1, 9 * STEP)]:
        table.covering(stop)
        assert table.length == length
    full_cos, full_sin = rope._cos_sin(torch.arange(table.length).view(1, 1, -1))
    assert torch.equal(table.cos, full_cos[0, :, : D // 2])
    assert torch.equal(table.sin, full_sin[0, :, : D // 2])
    assert table.pairs_halves  # Llama's cos/sin repeat their first half


def test_the_inverse_rows_are_made_once_per_table_size():
    table = model_ropes(make_rope_model("yarn"), 3)[0].table  # YaRN scales cos and sin: the norm is not 1
    cos, sin = table.covering(10)
    inverse = table.inverse()
    assert table.inverse() is inverse and len(table.tensors()) == 4  # cos, sin and their inverse rows
    norm = cos * cos + sin * sin
    assert not torch.allclose(norm, torch.ones_like(norm))
    assert torch.equal(inverse[0], cos / norm) and torch.equal(inverse[1], -sin / norm)
    cos, sin = table.covering(3 * STEP)
    norm = cos * cos + sin * sin
    assert table.inverse() is not inverse and table.inverse()[0].shape == (3 * STEP, D // 2)
    assert torch.equal(table.inverse()[0], cos / norm) and torch.equal(table.inverse()[1], -sin / norm)


def test_inverted_rows_undo_a_rotation_and_rotate_halves_leaves_the_other_channels():
    g = torch.Generator().manual_seed(7)
    angle = torch.rand(1, 6, 4, generator=g) * 6
    scale = 1.3  # an attention factor scales both (YaRN)
    cos, sin = scale * angle.cos(), scale * angle.sin()
    x = torch.randn(1, 6, 12, generator=g)  # 8 rotary channels of 12: the last 4 pass through
    turned = rope_table.rotate_halves(x, cos, sin)
    assert torch.equal(turned[..., 8:], x[..., 8:])
    torch.testing.assert_close(turned[..., :4], x[..., :4] * cos - x[..., 4:8] * sin)
    torch.testing.assert_close(rope_table.rotate_halves(turned, *rope_table.inverted(cos, sin)), x)


def test_matches_only_where_the_model_pairs_channels_by_halves(no_kernel):
    mine = model_ropes(make_tiny("llama"), 3)[0]
    assert rope_table.matches(mine, mine.table, D) and mine.fits_kernel(D) and mine._fits == {D: True}
    assert not rope_table.matches(mine, mine.table, D // 2)  # fewer channels than the rotary dims
    other = Rope(mine.rotary, interleaved_rotary)
    assert not other.fits_kernel(D) and other._rows(torch.zeros(1, 1, 3, dtype=torch.long), D, False) is None
    x, pos = torch.randn(1, 1, 3, D), torch.tensor([[[0, 5, 9]]])
    assert torch.equal(other.rotate(x, pos), other.rotate_by_module(x, pos))  # the module, the model's pairs
    assert not torch.allclose(other.rotate(x, pos), mine.rotate(x, pos))
