"""Low-rank cache: exact at full rank, real coefficient storage, saved and reused calibration."""

from __future__ import annotations

import pytest
import torch
from helpers import stream_logits
from transformers import DynamicCache

from kvcompress import build_cache
from kvcompress.core.cache import model_spec
from kvcompress.memory_model import predicted_bytes
from kvcompress.selectors import FullPolicy, LowRankPolicy, SchedulePolicy
from kvcompress.storage.low_rank import calibration
from kvcompress.storage.low_rank.bases import bases

HEAD_DIM = 16  # tiny models: hidden 64, 4 heads


def policy(tmp_path, **kw):
    return LowRankPolicy(
        **{"calibration_text": "random", "calibration_tokens": 64, **kw}, calibration_dir=str(tmp_path)
    )


def test_a_shared_basis_refuses_selectors_that_keep_different_tokens_per_head(llama):
    """One latent per token for several KV heads: a per-head selector (h2o) is refused naming basis=head;
    sliding_window keeps the same tokens in every head and runs over it; basis=head serves both."""
    joint = {"name": "low_rank", "basis": "joint", "rank": 3, "calibration_text": "random"}
    with pytest.raises(ValueError, match="h2o over storage=low_rank cannot work.*use basis=head"):
        build_cache("h2o", llama, budget=12, storage=joint)
    assert build_cache("sliding_window", llama, window=12, storage=joint) is not None
    assert build_cache("h2o", llama, budget=12, storage={**joint, "basis": "head"}) is not None


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


@pytest.mark.parametrize("keys", ["pre_rope", "post_rope"])
def test_stores_coefficients_and_exact_residual(keys, llama, tokens, tmp_path):
    p = policy(tmp_path, rank=3, value_rank=5, recent=6, basis="head", keys=keys, key_objective="keys")
    cache = build_cache(p, llama)
    layer, seen, values = _keys_seen(cache, llama, tokens)  # (1, H_kv, 48, D)
    store = layer.store
    assert store.key_coef.shape == (1, 2, 42, 3) and store.value_coef.shape == (1, 2, 42, 5)
    assert layer.keys.shape == (1, 2, 6, HEAD_DIM)
    torch.testing.assert_close(layer.keys, seen[:, :, -6:])  # newest tokens exact
    projected = seen[:, :, :42]
    if keys == "pre_rope":  # the latent of the un-rotated keys, at their own positions
        projected = store.rope.unrotate(projected, torch.arange(42).expand(1, 2, 42))
    torch.testing.assert_close(store.key_coef, projected @ store.key_basis, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(store.value_coef, values[:, :, :42] @ store.value_basis)
    eye = torch.eye(3).expand(2, 3, 3)
    torch.testing.assert_close(store.key_basis.mT @ store.key_basis, eye, atol=1e-5, rtol=0)  # orthonormal
    # coefficients + exact residual + int32 positions (pre-RoPE) + the layer's float32 bases (H_kv, D, r)
    positions = 4 * 2 * 48 if keys == "pre_rope" else 0
    bases = 4 * 2 * HEAD_DIM * (3 + 5)
    expected = 4 * (2 * 42 * (3 + 5) + 2 * 2 * 6 * HEAD_DIM) + positions + bases
    assert layer.memory_bytes() == expected
    assert store.key_coef.untyped_storage().nbytes() == store.key_coef.numel() * 4
    stats = layer.stats()
    assert stats["basis_bytes"] == bases and stats["position_bytes"] == positions
    assert p.storage.bytes_for(_shape(48), 48) + p.storage.fixed_bytes(_shape(48), 0) == expected


@pytest.mark.parametrize("keys", ["pre_rope", "post_rope"])
def test_query_aware_keys_keep_logits_better_than_plain_pca(keys, llama, tokens, tmp_path):
    """key_objective=logits: encoder/decoder biorthogonal, exact at full rank, smaller q.k error than PCA."""
    errors = {}
    for objective in ("logits", "keys"):
        p = policy(tmp_path, rank=4, basis="head", keys=keys, key_objective=objective)
        layer, seen, _ = _keys_seen(build_cache(p, llama), llama, tokens)
        store = layer.store
        eye = torch.eye(4).expand(2, 4, 4)
        torch.testing.assert_close(store.encoder["keys"].mT @ store.decoder["keys"], eye, atol=1e-4, rtol=0)
        q = torch.randn(2, 500, HEAD_DIM) @ _query_scale(p, keys, layer.layer_idx)  # calibration-like queries
        errors[objective] = float(((store.read()[0] - seen)[0] @ q.mT).square().mean())
    assert errors["logits"] < errors["keys"]
    full = build_cache(policy(tmp_path, rank=HEAD_DIM, keys=keys, basis="head"), llama)
    layer, seen, _ = _keys_seen(full, llama, tokens)
    torch.testing.assert_close(layer.store.read()[0], seen, atol=2e-5, rtol=1e-4)


def _query_scale(p, keys, layer_idx):
    """A square root (H_kv, D, D) of the calibration's query moment weighing this key mode."""
    moment = p.calibration["queries_pre" if keys == "pre_rope" else "queries_post"][layer_idx].double()
    lam, vec = torch.linalg.eigh(moment)
    return (vec @ torch.diag_embed(lam.clamp(min=0).sqrt()) @ vec.mT).float()


def _shape(tokens, batch=1, dtype_bytes=4):
    from kvcompress.core.spec import Shape

    return Shape(batch, 2, 4, HEAD_DIM, dtype_bytes, tokens, 0)


@pytest.mark.parametrize("basis", ["head", "group", "joint"])
@pytest.mark.parametrize("keys", ["pre_rope", "post_rope"])
def test_reconstruction_error_falls_with_rank(keys, basis, llama, tokens, tmp_path):
    errors = []
    for rank in (2, 4, 8, 12, 16):
        p = policy(tmp_path, rank=rank, keys=keys, basis=basis, group_size=2, recent=0)
        cache = build_cache(p, llama)
        layer, seen, _ = _keys_seen(cache, llama, tokens)
        recon = layer.store.read()[0]  # decoded (and re-rotated) keys
        errors.append(float((recon - seen).norm() / seen.norm()))
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)) and errors[-1] < 1e-5


def test_joint_basis_holds_one_latent_per_token(llama, tokens, tmp_path):
    cache = build_cache(policy(tmp_path, rank=3, basis="joint"), llama)
    layer, _, _ = _keys_seen(cache, llama, tokens)
    assert layer.store.key_coef.shape == (1, 1, 48, 6)  # rank 3 per KV head: 6 components for 2 heads
    assert layer.store.key_basis.shape == (1, 2 * HEAD_DIM, 6)
    assert layer.stats()["key_rank"] == 3 and layer.stats()["key_components"] == 6


def test_calibration_is_saved_and_reused(llama, tmp_path):
    calibration._MEMO.clear()
    first = build_cache(policy(tmp_path, rank=4), llama).policy.calibration
    files = list(tmp_path.glob("kv-moments-*.pt"))
    assert first["source"] == "computed" and len(files) == 1 and first["seconds"] > 0
    assert build_cache(policy(tmp_path, rank=8), llama).policy.calibration["source"] == "memory"
    calibration._MEMO.clear()
    again = build_cache(policy(tmp_path, rank=8), llama).policy.calibration  # another rank: same file
    assert again["source"] == "disk" and torch.equal(again["keys_pre"], first["keys_pre"])
    assert again["range"] == {"text": "random", "tokens": [0, 64], "chars": None}
    build_cache(policy(tmp_path, rank=4, calibration_tokens=32), llama)  # other data: another file
    assert len(list(tmp_path.glob("kv-moments-*.pt"))) == 2 and not list(tmp_path.glob(".*tmp"))


def test_calibration_depends_on_the_weights(tmp_path):
    from conftest import make_tiny

    a, b = make_tiny("llama"), make_tiny("llama")
    with torch.no_grad():
        b.model.layers[0].self_attn.k_proj.weight.mul_(2)
    assert calibration.model_fingerprint(a) != calibration.model_fingerprint(b)


@pytest.mark.parametrize("basis", ["head", "joint"])
def test_energy_chooses_the_fewest_components_per_layer(basis, llama, tmp_path):
    p = policy(tmp_path, energy=0.9, basis=basis)
    cache = build_cache(p, llama)
    g = 1 if basis == "head" else 2
    for kind, source, weight in (("key", "keys_pre", "queries_pre"), ("value", "values", None)):
        _, _, eig = bases(p.calibration, source, g, HEAD_DIM, weight)  # (L, G, g * D), decreasing
        share = eig.cumsum(-1) / eig.sum(-1, keepdim=True)
        for i, stats in enumerate(cache.stats()):
            r = stats[f"{kind}_components"]
            assert (share[i, :, r - 1] >= 0.9 - 1e-6).all() and (r == 1 or (share[i, :, r - 2] < 0.9).any())


@pytest.mark.parametrize("objective", ["logits", "keys"])
def test_error_allocation_spreads_the_same_total_with_less_error(objective, llama, tmp_path):
    uniform = build_cache(policy(tmp_path, rank=4, key_objective=objective), llama)
    spread = build_cache(policy(tmp_path, rank=4, allocation="error", key_objective=objective), llama)
    comps = [[s["key_components"] for s in c.stats()] for c in (uniform, spread)]
    assert comps[0] == [8, 8, 8] and sum(comps[1]) == 24
    weight = "queries_pre" if objective == "logits" else None
    _, _, eig = bases(spread.policy.calibration, "keys_pre", 2, HEAD_DIM, weight)
    if weight is None:  # plain PCA: each layer's share of its energy; logits: squared logit error as is
        eig = eig / eig.sum(-1, keepdim=True)
    lost = [sum(float(eig[i, 0, r:].sum()) for i, r in enumerate(c)) for c in comps]
    assert lost[1] <= lost[0]
    assert predicted_bytes(spread.policy, model_spec(llama), 48, 4) is None  # ranks come from calibration


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
        ({"rank": None, "energy": 0.9, "allocation": "error"}, "low_rank.allocation='error' needs rank"),
        ({"rank": 4, "energy": 0.9}, "exactly one of rank"),
        ({"rank": None, "energy": 1.5}, "low_rank.energy"),
        ({"recent": -1}, "low_rank.recent"),
        ({"calibration_tokens": 0}, "low_rank.calibration_tokens"),
        (
            {"keys": "rotated"},
            r"low_rank.keys='rotated' is not supported; allowed: \['pre_rope', 'post_rope'\]",
        ),
        ({"basis": "pair"}, "low_rank.basis='pair' is not supported"),
        ({"values": "low_rank"}, "low_rank.values must be another storage"),
        ({"values": "nope"}, "low_rank.values: storage='nope' is unknown"),
        ({"values": {"name": "quant", "bits": 3}}, r"low_rank.values: quant.bits=3"),
        ({"values": "dense", "value_rank": 4}, "value_rank=4 applies to values projected here"),
    ],
)
def test_rejects_bad_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        LowRankPolicy(**kw)


def test_model_dependent_checks(llama, tmp_path):
    with pytest.raises(ValueError, match="low_rank.rank=32 must be in \\[1, head_dim=16\\]"):
        build_cache(policy(tmp_path, rank=32), llama)
    with pytest.raises(
        ValueError, match=r"low_rank.group_size=3 must divide the model's 2 KV heads.*\[1, 2\]"
    ):
        build_cache(policy(tmp_path, rank=4, basis="group", group_size=3), llama)
    with pytest.raises(RuntimeError, match="not calibrated"):
        LowRankPolicy(rank=4).layer(0, None)


def test_int8_coefficients_store_codes_and_scales(llama, tokens, tmp_path):
    cache = build_cache(
        policy(
            tmp_path, rank=4, int8_coefficients=True, basis="head", keys="post_rope", key_objective="keys"
        ),
        llama,
    )
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
