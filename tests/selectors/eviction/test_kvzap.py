"""KVzap as published: KVzip+ targets against a float64 reference, the ridge fit against the closed form, a
tiny surrogate trained end to end that predicts its own targets better than a constant, the prompt kept by
the predicted ranking with the recent window, padding never kept, the artifact saved and loaded."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import stream_logits
from test_keydiff import ids_of

from kvcompress import build_cache
from kvcompress.selectors.eviction import kvzap_fit, kvzap_model
from kvcompress.selectors.eviction.kvzap import KVzapPolicy
from kvcompress.selectors.eviction.kvzap_targets import document_targets, kvzip_plus
from kvcompress.selectors.eviction.kvzip_prompts import Prompts

NO_PROMPTS = Prompts([], [], [], [])  # no tokenizer: the context is reconstructed as is
FIT = {"fit_text": "random", "fit_documents": 3, "fit_tokens": 24, "fit_holdout": 1, "fit_sample": 16}


def test_kvzip_plus_is_the_most_normalised_contribution_any_repeat_query_gives_a_context_pair():
    g = torch.Generator().manual_seed(0)
    h, h_kv, t, d, hid = 4, 2, 11, 3, 5
    q, k, v = torch.randn(h, t, d, generator=g), torch.randn(h_kv, t, d, generator=g), torch.randn(h_kv, t, d)
    x, wo = torch.randn(t, hid, generator=g), torch.randn(hid, h * d, generator=g)
    got = kvzip_plus(q, k, v, x, wo, (1, 5), (6, 11), 0.5)  # context 1..4, its repeat 6..10
    want = torch.full((h_kv, 4), -torch.inf, dtype=torch.float64)
    for head in range(h):
        kv = head // (h // h_kv)
        for row in range(6, 11):
            logits = (q[head, row].double() @ k[kv, : row + 1].double().T) * 0.5
            p = logits.softmax(-1)
            for j, key in enumerate(range(1, 5)):
                out = wo[:, head * d : (head + 1) * d].double() @ v[kv, key].double()
                s = p[key] * out.norm() / x[row].double().norm()
                want[kv, j] = max(want[kv, j], s.log())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_the_linear_surrogate_is_ridge_regression_with_a_free_intercept():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 300, 6, generator=g) + 3.0
    w, b = torch.randn(2, 6, 3, generator=g), torch.randn(2, 3, generator=g)
    y = x @ w + b[:, None] + 0.01 * torch.randn(2, 300, 3, generator=g)
    got = kvzap_model.fit_linear(x, y)
    xd = torch.cat([x.double(), torch.ones(2, 300, 1, dtype=torch.float64)], -1)
    reg = torch.eye(7, dtype=torch.float64) * kvzap_model.RIDGE_ALPHA
    reg[-1, -1] = 0  # the intercept is not penalised
    want = torch.linalg.solve(xd.transpose(1, 2) @ xd + reg, xd.transpose(1, 2) @ y.double())
    torch.testing.assert_close(got["w"].double(), want[:, :6], atol=1e-4, rtol=0)
    torch.testing.assert_close(got["b"].double(), want[:, 6], atol=1e-3, rtol=0)
    torch.testing.assert_close(got["w"], w, atol=0.02, rtol=0)  # and near the map that made the data


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_tiny_surrogate_trained_end_to_end_predicts_its_targets_better_than_a_constant(kind):
    model = make_tiny("llama")
    g = torch.Generator().manual_seed(3)
    docs = [document_targets(model, torch.randint(2, 90, (1, 32), generator=g), NO_PROMPTS) for _ in range(4)]
    x = torch.cat([f for f, _ in docs], dim=1)  # (L, N, hidden)
    y = torch.cat([s for _, s in docs], dim=1)  # (L, N, H_kv)
    params = (
        kvzap_model.fit_linear(x, y) if kind == "linear" else kvzap_model.fit_mlp(x, y, epochs=60, batch=32)
    )
    pred = kvzap_model.predict_all(params, x)
    constant = (y - y.mean(1, keepdim=True)).square().mean()
    assert float((pred - y).square().mean()) < 0.5 * float(constant)


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
def test_the_prompt_keeps_the_window_and_the_best_predicted_pairs_and_decode_appends(model_type):
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 36), generator=torch.Generator().manual_seed(4))
    cache = build_cache("kvzap", model, budget=12, compression_ratio=None, window=5, model_type=model_type,
                        **FIT)  # fmt: skip
    full = build_cache("full", model)
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, k: inputs.__setitem__(m.layer_idx, k["hidden_states"]), with_kwargs=True)
        for layer in model.model.layers]  # fmt: skip
    stream_logits(model, ids[:, :30], full, chunk=30)
    for hook in hooks:
        hook.remove()
    stream_logits(model, ids[:, :30], cache, chunk=30)
    surrogate = cache.policy.surrogate
    assert surrogate["kind"] == model_type
    for i, (layer, whole) in enumerate(zip(cache.layers, full.layers, strict=True)):
        pred = kvzap_model.predict(surrogate, i, inputs[i]).double()  # (1, H_kv, 30)
        pred[..., 25:] = float("inf")  # the window
        want = pred.topk(12, dim=-1).indices.sort(dim=-1).values
        assert ids_of(layer.keys, whole.keys) == want.tolist()
    stream_logits(model, ids[:, 30:], cache, chunk=1)
    assert [layer.stored_length() for layer in cache.layers] == [12 + 6] * len(cache.layers)


def test_a_padded_row_keeps_what_it_keeps_alone_and_never_its_padding():
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (2, 30), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :10] = 0
    fields = {"compression_ratio": 0.5, "window": 3, **FIT}
    both, alone, full = build_cache("kvzap", model, **fields), build_cache("kvzap", model, **fields), None
    with torch.inference_mode():
        model(ids, attention_mask=mask, cache=both)
        model(ids[1:, 10:], cache=alone)
        full = build_cache("full", model)
        model(ids[1:, 10:], cache=full)
    for layer, one, whole in zip(both.layers, alone.layers, full.layers, strict=True):
        kept = layer.valid[1].expand(layer.values.shape[1], -1)  # (H_kv, T) real slots of row 1
        assert kept.sum(-1).tolist() == [10] * kept.shape[0]  # half of its 20 real tokens, no padding
        row = torch.stack([layer.values[1, h][kept[h]] for h in range(kept.shape[0])])[None]
        assert nearest(row, whole.values) == nearest(one.values, whole.values)


def nearest(stored: torch.Tensor, values: torch.Tensor) -> list:
    """Which of ``values`` (1, H, T, D) each stored value (1, H, k, D) is (the padded row's RoPE positions and
    sums differ by rounding only), sorted per head."""
    dist = (stored[:, :, :, None] - values[:, :, None]).norm(dim=-1)  # (1, H, k, T)
    assert float(dist.amin(-1).max()) < 1e-4
    return dist.argmin(-1).sort(dim=-1).values.tolist()


def test_the_surrogates_are_saved_once_and_loaded_by_their_settings(tmp_path, monkeypatch):
    model = make_tiny("llama")
    monkeypatch.setattr(kvzap_fit, "_MEMO", {})
    first = kvzap_fit.scorer(model, "random", 3, 24, 1, 16, tmp_path)
    monkeypatch.setattr(kvzap_fit, "_MEMO", {})
    again = kvzap_fit.scorer(model, "random", 3, 24, 1, 16, tmp_path)
    other = kvzap_fit.scorer(model, "random", 3, 24, 1, 8, tmp_path)
    assert (first["source"], again["source"], other["source"]) == ("computed", "disk", "computed")
    assert (
        torch.equal(first["mlp"]["w1"], again["mlp"]["w1"])
        and first["path"] == again["path"] != other["path"]
    )
    assert f"kvzap-v{kvzap_fit.VERSION}-" in first["path"] and first["train_pairs"] == 2 * 16
    assert set(first["fit"]) == {"linear", "mlp"}
    assert {"r2", "pearson", "recall_at_0.75", "recall_at_0.9", "per_layer"} <= set(first["fit"]["mlp"])
    assert len(first["fit"]["linear"]["per_layer"]["r2"]) == 3  # one per layer
    assert first["linear"]["w"].shape == (3, 64, 2) and first["mlp"]["w1"].shape == (3, 64, 512)


def test_a_holdout_that_leaves_nothing_to_fit_on_and_an_unknown_model_type_are_refused_by_name():
    with pytest.raises(ValueError, match="kvzap.fit_holdout=3 must be below kvzap.fit_documents=3"):
        KVzapPolicy(fit_documents=3, fit_holdout=3)
    with pytest.raises(ValueError, match="model_type"):
        KVzapPolicy(model_type="tree")


def test_a_threshold_keeps_per_head_the_pairs_predicted_at_least_it_plus_the_window():
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 40), generator=torch.Generator().manual_seed(6))
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, k: inputs.__setitem__(m.layer_idx, k["hidden_states"]), with_kwargs=True)
        for layer in model.model.layers]  # fmt: skip
    stream_logits(model, ids, build_cache("full", model), chunk=40)
    for hook in hooks:
        hook.remove()
    cache = build_cache("kvzap", model, threshold=-7.5, compression_ratio=None, window=4, **FIT)
    stream_logits(model, ids, cache, chunk=40)
    counts = []
    for i, layer in enumerate(cache.layers):
        pred = kvzap_model.predict(cache.policy.surrogate, i, inputs[i])[0]  # (H_kv, 40)
        keep = pred >= -7.5
        keep[:, -4:] = True  # the window
        assert layer.stats()["tokens_per_head"] == keep.sum(-1).tolist()
        counts += keep.sum(-1).tolist()
    assert len(set(counts)) > 1  # heads keep their own counts
    more = torch.randint(2, 90, (1, 3), generator=torch.Generator().manual_seed(8))
    stream_logits(model, more, cache, chunk=1)  # decode steps over the flat pairs: each scored, none evicted
    for layer, n in zip(
        cache.layers, [sum(counts[i : i + 2]) for i in range(0, len(counts), 2)], strict=True
    ):
        assert layer.store.length == n + 3 * 2 and layer.zscore.shape == (1, 1, n + 3 * 2)


def test_evict_at_always_keeps_the_ratio_at_every_decode_step():
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 40), generator=torch.Generator().manual_seed(7))
    cache = build_cache("kvzap", model, compression_ratio=0.5, window=4, evict_at="always", **FIT)
    stream_logits(model, ids[:, :30], cache, chunk=30)
    assert [layer.stored_length() for layer in cache.layers] == [15] * 3
    for t in range(30, 40):
        stream_logits(model, ids[:, t : t + 1], cache, chunk=1)
        assert [layer.stored_length() for layer in cache.layers] == [(t + 1) // 2] * 3
