"""Low-rank cache: exact at full rank, real coefficient storage, saved and reused calibration."""

from __future__ import annotations

import pytest
import torch
from helpers import stream_logits
from transformers import DynamicCache

from kvcompress import build_cache, calibration
from kvcompress.policies import FullPolicy, LowRankPolicy, SchedulePolicy

HEAD_DIM = 16  # tiny models: hidden 64, 4 heads


def policy(tmp_path, **kw):
    return LowRankPolicy(
        **{"calibration_text": "random", "calibration_tokens": 64, **kw}, calibration_dir=str(tmp_path)
    )


@pytest.mark.parametrize("chunk", [1, 9])
def test_full_rank_reproduces_full_cache(chunk, tiny_model, tokens, tmp_path):
    ref = stream_logits(tiny_model, tokens, DynamicCache(config=tiny_model.config), chunk=chunk)
    cache = build_cache(policy(tmp_path, rank=HEAD_DIM), tiny_model)
    got = stream_logits(tiny_model, tokens, cache, chunk=chunk)
    assert cache.stats()[0]["tokens_projected"] == 48  # everything went through the projection
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def _keys_seen(cache, model, tokens, chunk=5):
    seen = []
    layer = cache.layers[1]
    orig = layer.update

    def spy(k, v, *a, **kw):
        seen.append((k.clone(), v.clone()))
        return orig(k, v, *a, **kw)

    layer.update = spy
    stream_logits(model, tokens, cache, chunk=chunk)
    return layer, torch.cat([k for k, _ in seen], -2), torch.cat([v for _, v in seen], -2)


def test_stores_coefficients_and_exact_residual(llama, tokens, tmp_path):
    cache = build_cache(policy(tmp_path, rank=3, value_rank=5, residual_length=6), llama)
    layer, keys, values = _keys_seen(cache, llama, tokens)  # (1, H_kv, 48, D)
    assert layer.store.key_coef.shape == (1, 2, 42, 3) and layer.store.value_coef.shape == (1, 2, 42, 5)
    assert layer.keys.shape == (1, 2, 6, HEAD_DIM)
    torch.testing.assert_close(layer.keys, keys[:, :, -6:])  # newest tokens exact
    torch.testing.assert_close(layer.store.key_coef, keys[:, :, :42] @ layer.store.key_basis)
    torch.testing.assert_close(layer.store.value_coef, values[:, :, :42] @ layer.store.value_basis)
    eye = torch.eye(3).expand(2, 3, 3)
    torch.testing.assert_close(
        layer.store.key_basis.mT @ layer.store.key_basis, eye, atol=1e-5, rtol=0
    )  # orthonormal
    # bytes: coefficients + exact residual + the layer's two bases (H_kv, D, r), float32
    expected = 4 * (2 * 42 * (3 + 5) + 2 * 2 * 6 * HEAD_DIM + 2 * HEAD_DIM * (3 + 5))
    assert layer.memory_bytes() == expected
    assert layer.store.key_coef.untyped_storage().nbytes() == layer.store.key_coef.numel() * 4


def test_reconstruction_error_falls_with_rank(llama, tokens, tmp_path):
    errors = []
    for rank in (2, 4, 8, 12, 16):
        cache = build_cache(policy(tmp_path, rank=rank), llama)
        layer, keys, _ = _keys_seen(cache, llama, tokens)
        recon = layer.store.key_coef @ layer.store.key_basis.mT
        errors.append(float((recon - keys).norm() / keys.norm()))
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)) and errors[-1] < 1e-5


def test_calibration_is_saved_and_reused(llama, tmp_path):
    calibration._MEMO.clear()
    first = build_cache(policy(tmp_path, rank=4), llama).policy.calibration
    files = list(tmp_path.glob("kv-basis-*.pt"))
    assert first["source"] == "computed" and len(files) == 1 and first["seconds"] > 0
    assert build_cache(policy(tmp_path, rank=8), llama).policy.calibration["source"] == "memory"
    calibration._MEMO.clear()
    again = build_cache(policy(tmp_path, rank=8), llama).policy.calibration  # another rank: same file
    assert again["source"] == "disk" and torch.equal(again["key_basis"], first["key_basis"])
    build_cache(policy(tmp_path, rank=4, calibration_tokens=32), llama)  # other data: another file
    assert len(list(tmp_path.glob("kv-basis-*.pt"))) == 2 and not list(tmp_path.glob(".*tmp"))


def test_calibration_depends_on_the_weights(tmp_path):
    from conftest import make_tiny

    a, b = make_tiny("llama"), make_tiny("llama")
    with torch.no_grad():
        b.model.layers[0].self_attn.k_proj.weight.mul_(2)
    assert calibration.model_fingerprint(a) != calibration.model_fingerprint(b)


def test_energy_chooses_the_fewest_components_per_layer(llama, tmp_path):
    p = policy(tmp_path, energy=0.9)
    cache = build_cache(p, llama)
    for i, stats in enumerate(cache.stats()):
        for kind in ("key", "value"):
            eig = p.calibration[f"{kind}_energy"][i]  # (H_kv, D), decreasing
            share = eig.cumsum(-1) / eig.sum(-1, keepdim=True)
            r = stats[f"{kind}_rank"]
            assert (share[:, r - 1] >= 0.9 - 1e-6).all() and (r == 1 or (share[:, r - 2] < 0.9).any())


def test_schedule_sets_rank_per_layer(llama, tokens, tmp_path):
    rules = [{"layers": "0", "policy": FullPolicy()}, {"layers": "2", "policy": policy(tmp_path, rank=2)}]
    cache = build_cache(SchedulePolicy(default=policy(tmp_path, rank=8), rules=rules), llama)
    stream_logits(llama, tokens, cache, chunk=8)
    assert [s.get("key_rank") for s in cache.stats()] == [None, 8, 2]


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"rank": 0}, "low_rank.rank"),
        ({"rank": 4, "value_rank": 0}, "low_rank.value_rank"),
        ({"rank": None, "energy": 0.9, "value_rank": 4}, "low_rank.value_rank=4 needs rank"),
        ({"rank": 4, "energy": 0.9}, "exactly one of rank"),
        ({"rank": None, "energy": 1.5}, "low_rank.energy"),
        ({"residual_length": -1}, "low_rank.residual_length"),
        ({"calibration_tokens": 0}, "low_rank.calibration_tokens"),
    ],
)
def test_rejects_bad_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        LowRankPolicy(**kw)


def test_model_dependent_checks(llama, tmp_path):
    with pytest.raises(ValueError, match="low_rank.rank=32 must be in \\[1, head_dim=16\\]"):
        build_cache(policy(tmp_path, rank=32), llama)
    with pytest.raises(ValueError, match="calibration_text='pg_essays' needs the model's tokenizer"):
        build_cache(LowRankPolicy(rank=4, calibration_dir=str(tmp_path)), llama)
    with pytest.raises(RuntimeError, match="not calibrated"):
        LowRankPolicy(rank=4).layer(0, None)


def test_int8_coefficients_store_codes_and_scales(llama, tokens, tmp_path):
    cache = build_cache(policy(tmp_path, rank=4, int8_coefficients=True), llama)
    layer, keys, _ = _keys_seen(cache, llama, tokens)
    assert layer.store.key_coef.dtype == layer.store.value_coef.dtype == torch.int8
    assert layer.store.key_scale.shape == (1, 2, 48, 1)
    exact = keys @ layer.store.key_basis  # (1, H_kv, 48, 4)
    assert (
        (layer.store.key_coef.float() * layer.store.key_scale - exact).abs()
        <= layer.store.key_scale / 2 + 1e-6
    ).all()
    assert (layer.store.key_coef.abs().amax(-1) == 127).all()  # absmax scaling uses the whole int8 range
    # int8 codes + one float32 scale per token and head (keys and values) + the two float32 bases
    assert layer.memory_bytes() == 2 * (2 * 48 * 4) + 2 * (2 * 48 * 4) + 2 * (2 * HEAD_DIM * 4 * 4)
