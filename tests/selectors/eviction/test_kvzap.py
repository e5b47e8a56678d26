"""KVzap's learned scorer: RoPE-invariant features, the ridge fit against a float64 solve, targets equal to
the context pass's own KVzip scores, the prompt kept by the predicted ranking, the scorer saved and loaded."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import stream_logits
from test_keydiff import ids_of

from kvcompress import build_cache
from kvcompress.core.policy import ModelSpec
from kvcompress.runtime.context_pass import compress_context
from kvcompress.selectors.eviction import kvzap_fit
from kvcompress.selectors.eviction.kvzap import KVzapPolicy
from kvcompress.selectors.eviction.kvzip import KVzipLayer

FIT = {"fit_text": "random", "fit_documents": 3, "fit_tokens": 24, "fit_holdout": 1}


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (..., T, D) in float64 at ``positions`` (T,)."""
    d = x.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * freq  # (T, D / 2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def test_the_key_features_do_not_change_with_the_position_rope_turns_a_key_by():
    keys = torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(1))
    at_zero = kvzap_fit.features(keys.float(), values)
    moved = kvzap_fit.features(_rope(keys, torch.tensor([3, 40, 7, 900, 12])).float(), values)
    torch.testing.assert_close(moved, at_zero, atol=1e-5, rtol=0)
    assert at_zero.shape == (1, 2, 5, 4 + 8 + 1) and bool((at_zero[..., -1] == 1).all())


def test_the_fit_solves_ridge_regression_as_float64_does():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 200, 6, generator=gen)
    w = torch.randn(3, 6, generator=gen)
    y = torch.einsum("hnf,hf->hn", x, w) + 0.01 * torch.randn(3, 200, generator=gen)
    got = kvzap_fit.solve(x, y)
    xd, yd = x.double(), y.double()
    gram = xd.transpose(1, 2) @ xd
    reg = (
        kvzap_fit.RIDGE * gram.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(6, dtype=xd.dtype)
    )
    want = torch.linalg.solve(gram + reg, xd.transpose(1, 2) @ yd[..., None])[..., 0]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, w, atol=0.01, rtol=0)  # and near the weights that made the data


def test_the_fit_targets_are_the_context_pass_scores_of_kvzip(monkeypatch):
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 20), generator=torch.Generator().manual_seed(3))
    feats, targets = kvzap_fit.document_targets(model, ids, [])
    seen = []
    end = KVzipLayer.end_pass
    monkeypatch.setattr(KVzipLayer, "end_pass", lambda self, **kw: (seen.append(self.pass_scores[0].clone()),
                                                                     end(self, **kw))[1])  # fmt: skip
    cache = build_cache("kvzip", model, budget=8, compression_ratio=None, context_chunk=64, sink_tokens=0)
    with torch.inference_mode():
        model(ids, cache=cache)
        compress_context(model, cache, ids)  # no tokenizer: the context is reconstructed as is
    torch.testing.assert_close(targets, torch.stack(seen), atol=1e-5, rtol=1e-4)
    assert feats.shape[:3] == targets.shape


@pytest.mark.parametrize("window", [0, 5])
def test_the_prompt_keeps_the_pairs_the_scorer_ranks_first_and_decode_appends(window):
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 36), generator=torch.Generator().manual_seed(4))
    fields = {"budget": 12, "compression_ratio": None, "sink_tokens": 2, "window": window, **FIT}
    cache = build_cache("kvzap", model, **fields)
    full = build_cache("full", model)
    stream_logits(model, ids[:, :30], full, chunk=30)
    stream_logits(model, ids[:, :30], cache, chunk=30)
    weights = cache.layers[0].policy.weights
    for i, (layer, whole) in enumerate(zip(cache.layers, full.layers, strict=True)):
        keys, values = whole.keys, whole.values  # (1, H_kv, 30, D)
        pred = kvzap_fit.predict(weights[i], keys, values).double()  # (1, H_kv, 30)
        pred[..., :2] = float("inf")  # the sinks
        pred[..., 30 - window :] = float("inf")  # the window
        want = pred.topk(12, dim=-1).indices.sort(dim=-1).values
        assert ids_of(layer.keys, keys) == want.tolist()
    stream_logits(model, ids[:, 30:], cache, chunk=1)
    assert [layer.stored_length() for layer in cache.layers] == [12 + 6] * len(cache.layers)


def test_the_scorer_is_saved_once_and_loaded_by_its_settings(tmp_path, monkeypatch):
    model = make_tiny("llama")
    monkeypatch.setattr(kvzap_fit, "_MEMO", {})
    first = kvzap_fit.scorer(model, "random", 3, 24, 1, tmp_path)
    monkeypatch.setattr(kvzap_fit, "_MEMO", {})
    again = kvzap_fit.scorer(model, "random", 3, 24, 1, tmp_path)
    other = kvzap_fit.scorer(model, "random", 4, 24, 1, tmp_path)
    assert (first["source"], again["source"], other["source"]) == ("computed", "disk", "computed")
    assert torch.equal(first["weights"], again["weights"]) and first["path"] == again["path"] != other["path"]
    assert set(first["fit"]) == {"r2_log_score", "spearman", "recall_at_0.75", "recall_at_0.9"}
    spec = ModelSpec(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=64)
    assert first["weights"].shape == (spec.num_layers, spec.num_kv_heads, 16 // 2 + 16 + 1)


def test_a_holdout_that_leaves_nothing_to_fit_on_is_refused_by_name():
    with pytest.raises(ValueError, match="kvzap.fit_holdout=3 must be below kvzap.fit_documents=3"):
        KVzapPolicy(fit_documents=3, fit_holdout=3)
