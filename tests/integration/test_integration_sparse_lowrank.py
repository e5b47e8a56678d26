"""block_sparse and low_rank on the embedded default model (its calibration is computed once, then reused)."""

from __future__ import annotations

import pytest
import torch

from kvcompress import build_cache, load_text
from kvcompress.metrics import decode_perplexity
from kvcompress.metrics.memory import read_summary
from kvcompress.selectors import LowRankPolicy
from kvcompress.storage.low_rank import bases as lrb

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def essay_ids(real_model):
    _, tok = real_model
    return tok(load_text("pg_essays")[:20000], return_tensors="pt").input_ids[:, :160]


def _real_keys(model, ids):
    cache = build_cache("full", model)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    return [layer.keys[0] for layer in cache.layers]  # per layer (H_kv, T, D), post-RoPE


def _error(keys, bases, rank):
    """Relative error of projecting every layer's keys (H_kv, T, D) on the first ``rank`` basis vectors."""
    num = den = 0.0
    for k, basis in zip(keys, bases, strict=True):
        b = basis[:, :, :rank]  # (H_kv, D, r)
        num += float(((k @ b) @ b.mT - k).pow(2).sum())
        den += float(k.pow(2).sum())
    return (num / den) ** 0.5


def test_reconstruction_error_on_real_keys_falls_with_rank(real_model, essay_ids):
    model, _ = real_model
    policy = LowRankPolicy(rank=32, keys="post_rope", basis="head", key_objective="keys")
    build_cache(policy, model)  # calibrates on the essays' last tokens (evaluation keys: the first ones)
    bases = lrb.bases(policy.calibration, "keys_post", 1, 64)[0]  # (L, H_kv, D, D) per-head PCA
    keys = _real_keys(model, essay_ids)
    errors = [_error(keys, bases, r) for r in (4, 8, 16, 32, 48, 64)]
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False))
    assert errors[-1] < 1e-4  # the full basis is orthonormal: exact up to float error
    g = torch.Generator().manual_seed(0)
    random = [torch.linalg.qr(torch.randn(b.shape, generator=g)).Q for b in bases]
    assert errors[3] < 0.5 * _error(keys, random, 32)  # calibration beats a random basis of the same rank


def test_block_sparse_reads_a_fraction_and_stays_close_to_full(real_model, essay_ids):
    model, _ = real_model
    ids = essay_ids[:, :96]  # 12 pages of 8 at the end
    full = decode_perplexity(model, ids, build_cache("full", model), progress=False)
    cache = build_cache("block_sparse", model, block_size=8, read_ratio=0.5)
    sparse = decode_perplexity(model, ids, cache, progress=False)
    reads = read_summary(cache.stats())
    assert 0.5 <= reads["pages_read_fraction"] < 0.65  # ceil() and the forced pages add a little
    assert reads["kv_bytes_read_per_step"] < 0.7 * reads["full_read_bytes_per_step"]
    assert full["perplexity"] * 0.9 < sparse["perplexity"] < full["perplexity"] * 1.5


def test_block_evict_keeps_whole_blocks_under_budget_close_to_full(real_model, essay_ids):
    model, _ = real_model
    ids = essay_ids[:, :96]
    full_cache = build_cache("full", model)
    full = decode_perplexity(model, ids, full_cache, progress=False)
    cache = build_cache("block_evict", model, block_size=8, budget=48, recent=8)
    evict = decode_perplexity(model, ids, cache, progress=False)
    stats = cache.stats()
    # 95 tokens seen: sink block 0 + recent blocks 10, 11 (80..94: 15 tokens) + 3 scored blocks = 47
    assert all(s["tokens_stored"] == 47 and s["blocks_stored"] == 6 for s in stats)
    assert cache.memory_bytes() < 0.52 * full_cache.memory_bytes()
    assert full["perplexity"] * 0.9 < evict["perplexity"] < full["perplexity"] * 1.5


def test_pre_rope_joint_query_aware_keys_keep_perplexity(real_model, essay_ids):
    """Rank-32 keys (half the key bytes), values dense: the default (pre-RoPE, joint, query-aware) stays near
    full; the earlier storage (post-RoPE, per head, plain PCA) does not."""
    model, _ = real_model
    ids = essay_ids[:, :128]
    old = {"keys": "post_rope", "basis": "head", "key_objective": "keys"}
    ppl = {}
    for name, kw in {"full": None, "default": {}, "old": old}.items():
        policy = "full" if kw is None else LowRankPolicy(rank=32, values="dense", **kw)
        ppl[name] = decode_perplexity(model, ids, build_cache(policy, model), progress=False)["perplexity"]
    assert ppl["default"] < 1.06 * ppl["full"] and ppl["old"] > 1.3 * ppl["full"], ppl
