"""When a scoring selector evicts (``evict_at``) and by a ``threshold``: each paper's default, decode steps
that append under ``prefill``, real per-head counts under a threshold, and every refusal by name."""

from __future__ import annotations

import pytest
import torch

from kvcompress import build_cache
from kvcompress.core.cache import make_policy
from kvcompress.metrics.compression import effective_ratios
from kvcompress.selectors.eviction.keydiff import keydiff_scores

G = torch.Generator().manual_seed(7)
IDS = torch.randint(2, 95, (1, 48), generator=G)
STEPS = torch.randint(2, 95, (1, 5), generator=G)


@torch.inference_mode()
def _run(model, cache, decode: int = 0) -> None:
    model(IDS, cache=cache)
    for i in range(decode):
        model(STEPS[:, i : i + 1], cache=cache)


@pytest.mark.parametrize(
    "name,paper",
    [("h2o", "always"), ("tova", "always"), ("keydiff", "always"), ("rkv", "always"), ("snapkv", "prefill"),
     ("expected_attention", "prefill"), ("kvzip", "prefill"), ("kvzap", "prefill"), ("pyramidkv", "prefill")],
)  # fmt: skip
def test_each_selector_evicts_when_its_paper_does_by_default(name, paper):
    assert make_policy(name).evicts == paper


@pytest.mark.parametrize("name", ["h2o", "tova", "keydiff"])
def test_prefill_only_cuts_the_prompt_once_and_decode_tokens_append(name, llama):
    prefill = build_cache(name, llama, budget=12, compression_ratio=None, evict_at="prefill")
    always = build_cache(name, llama, budget=12, compression_ratio=None)
    _run(llama, prefill, decode=5)
    _run(llama, always, decode=5)
    for layer in prefill.layers:
        assert layer.stored_length() == 12 + 5 and layer.evicted == 48 - 12
        assert layer.stats()["evict_at"] == "prefill"
    assert all(layer.stored_length() == 12 and layer.evicted == 53 - 12 for layer in always.layers)


def test_snapkv_evicting_always_recompresses_at_every_decode_step(llama):
    cache = build_cache("snapkv", llama, budget=12, compression_ratio=None, observation_window=4,
                        evict_at="always")  # fmt: skip
    assert cache.policy.slack == 0
    _run(llama, cache, decode=5)
    assert all(layer.stored_length() == 12 for layer in cache.layers)


@pytest.mark.parametrize(
    "name,fields,match",
    [
        ("expected_attention", {"evict_at": "always"}, r"expected_attention.evict_at='always' is not served"),
        ("kvzip", {"evict_at": "always"}, r"kvzip.evict_at='always' is not served: its scores come from"),
        ("snapkv", {"slack": 4}, r"snapkv.slack=4 re-compresses at decode steps, but evict_at='prefill'"),
        ("tova", {"threshold": 0.1}, r"tova.threshold=0.1 with evict_at='always'"),
        ("snapkv", {"threshold": 0.1, "adaptive": True}, r"threshold with adaptive=true"),
        ("snapkv", {"threshold": 0.1, "storage": "quant"}, r"snapkv.threshold=0.1 stores each head's own"),
        ("snapkv", {"threshold": 0.1, "compression_ratio": 0.5}, r"set exactly one of budget .*threshold"),
        ("h2o", {"evict_at": "sometimes"}, r"h2o.evict_at='sometimes' is not supported; allowed"),
    ],
)
def test_combinations_that_cannot_work_are_refused_by_name(name, fields, match):
    with pytest.raises(ValueError, match=match):
        make_policy(name, **fields)


def test_a_threshold_keeps_each_heads_own_pairs_at_or_above_it(llama):
    """KeyDiff's priorities depend on the keys alone: each (layer, KV head) keeps exactly the prompt pairs
    scoring at least the threshold, stored as that many pairs (no padding), and the records say so."""
    full = build_cache("full", llama)
    _run(llama, full)
    cache = build_cache("keydiff", llama, threshold=-0.2, compression_ratio=None, evict_at="prefill")
    _run(llama, cache)
    ratios = effective_ratios(cache.stats())
    counts = []
    for ref, layer, per_head in zip(
        full.layers, cache.layers, ratios["effective_ratio_per_head"], strict=True
    ):
        want = (keydiff_scores(ref.keys, None) >= -0.2).sum(-1)[0].clamp(min=1)  # (H_kv,)
        got = torch.bincount(layer.head_of[0, 0].long(), minlength=want.numel())
        assert got.tolist() == want.tolist() and layer.store.length == int(want.sum())
        assert per_head == pytest.approx([1.0 - int(n) / 48 for n in want], abs=1e-6)
        counts += want.tolist()
    assert len(set(counts)) > 1  # heads really keep different numbers of tokens
    assert ratios["effective_compression_ratio"] == pytest.approx(1.0 - sum(counts) / (48 * len(counts)))


def test_a_threshold_above_every_score_keeps_the_protected_tokens_and_one_pair_per_head(llama):
    cache = build_cache("snapkv", llama, threshold=1e5, compression_ratio=None, observation_window=4)
    _run(llama, cache, decode=2)
    for layer in cache.layers:
        assert layer.stats()["tokens_per_head"] == [4 + 2] * llama.config.num_key_value_heads


def test_a_threshold_refuses_a_batch_whose_rows_keep_different_counts(llama):
    cache = build_cache("keydiff", llama, threshold=-0.2, compression_ratio=None, evict_at="prefill")
    ids = torch.cat([IDS, torch.randint(2, 95, (1, 48), generator=G)])
    with pytest.raises(ValueError, match=r"keydiff.threshold: the rows of this batch keep"), torch.no_grad():
        llama(ids, cache=cache)
