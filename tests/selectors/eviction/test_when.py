"""When a scoring selector evicts (``evict_at``) and by a ``threshold``: each paper's default, decode steps
that append under ``prefill``, real per-head counts under a threshold, and every refusal by name."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from kvcompress import build_cache
from kvcompress.core.cache import make_policy
from kvcompress.metrics.compression import effective_ratios
from kvcompress.selectors.eviction.keydiff import keydiff_scores

G = torch.Generator().manual_seed(7)
IDS = torch.randint(2, 95, (1, 48), generator=G)
STEPS = torch.randint(2, 95, (1, 5), generator=G)
TWO_SIZES = r"one of budget \(.*\) or compression_ratio \([^)]*\); got budget=4, compression_ratio=0.5$"


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
        (
            "keydiff",
            {"threshold": 0.1},
            r"keydiff.threshold=0.1 with evict_at='always': .*kvzap",
        ),
        ("snapkv", {"threshold": 0.1, "adaptive": True}, r"threshold with adaptive=true"),
        ("snapkv", {"threshold": 0.1, "storage": "quant"}, r"snapkv.threshold=0.1 stores each head's own"),
        ("snapkv", {"threshold": 0.1, "compression_ratio": 0.5}, r"set exactly one of budget .*threshold"),
        ("h2o", {"evict_at": "sometimes"}, r"h2o.evict_at='sometimes' is not supported; allowed"),
        ("h2o", {"threshold": 0.5, "compression_ratio": None, "unit": "chunk"}, r"threshold with unit=chunk"),
        ("block_evict", {"budget": 4, "compression_ratio": 0.5}, TWO_SIZES),
        ("pyramidkv", {"budget": 4, "compression_ratio": 0.5}, TWO_SIZES),
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


def _below_threshold_outside(layer, scores: torch.Tensor, threshold: float, protected: int) -> int:
    """Stored pairs of a flat layer outside its newest ``protected`` tokens that score below ``threshold``
    and are not their head's best (what an eviction by threshold must have removed)."""
    h = layer.spec.num_kv_heads
    heads = layer.head_of[0, 0].long()
    below = scores[0, 0] < threshold
    below[scores.shape[-1] - protected * h :] = False
    for head in range(h):  # each head's best pair stays whatever it scores
        own = torch.where(heads == head, scores[0, 0].double(), -torch.inf)
        below[own.argmax()] = False
    return int(below.sum())


@pytest.mark.parametrize("every", [1, 3])
def test_h2o_with_a_threshold_evicts_at_decode_steps_every_threshold_every_tokens(llama, every):
    """``evict_at: always`` with a threshold: every ``threshold_every`` tokens seen, each flat pair whose
    accumulated attention is below the threshold leaves; in between the new pairs are appended."""
    cache = build_cache("h2o", llama, threshold=0.3, compression_ratio=None, threshold_every=every)
    _run(llama, cache)
    h = llama.config.num_key_value_heads
    before = [layer.store.length for layer in cache.layers]
    for step in range(5):
        with torch.inference_mode():
            llama(STEPS[:, step : step + 1], cache=cache)
        for i, layer in enumerate(cache.layers):
            seen = 48 + step + 1
            if seen % every:  # no eviction: the step's pairs were appended
                assert layer.store.length == before[i] + h
            else:
                assert _below_threshold_outside(layer, layer.acc, 0.3, 0) == 0
            before[i] = layer.store.length
    assert any(n < (48 + 5) * h for n in before)  # decode steps really evicted


def test_kvzap_with_a_threshold_evicts_while_decoding_and_keeps_its_window():
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 50), generator=torch.Generator().manual_seed(9))
    fit = {"fit_text": "random", "fit_documents": 3, "fit_tokens": 24, "fit_holdout": 1, "fit_sample": 16}
    cache = build_cache("kvzap", model, threshold=-7.5, compression_ratio=None, window=4, evict_at="always",
                        threshold_every=1, **fit)  # fmt: skip
    with torch.inference_mode():
        model(ids[:, :30], cache=cache)
        prefill = [layer.store.length for layer in cache.layers]
        for t in range(30, 50):
            model(ids[:, t : t + 1], cache=cache)
            for layer in cache.layers:
                assert _below_threshold_outside(layer, layer.zscore, -7.5, 4) == 0
                newest = layer.head_of[0, 0, -4 * 2 :].long().tolist()
                assert newest == [0, 1] * 4  # the window's tokens keep every head's pair
    grown = [layer.store.length - n for layer, n in zip(cache.layers, prefill, strict=True)]
    assert any(g < 20 * 2 for g in grown)  # pairs left at decode steps


@pytest.mark.parametrize("name,score", [("h2o", "acc"), ("kvzap", "zscore")])
def test_a_threshold_while_decoding_holds_in_bfloat16(name, score):
    """The flat eviction by threshold in the model dtype most runs use: finite logits, and after every
    eviction no pair outside the protected window scores below the threshold."""
    model = make_tiny("llama").to(torch.bfloat16)
    fit = {"fit_text": "random", "fit_documents": 3, "fit_tokens": 24, "fit_holdout": 1, "fit_sample": 16}
    fields = {"threshold": -7.5, "window": 4, **fit} if name == "kvzap" else {"threshold": 0.3}
    cache = build_cache(name, model, compression_ratio=None, evict_at="always", threshold_every=1, **fields)
    protected = 4 if name == "kvzap" else 0
    with torch.inference_mode():
        model(IDS[:, :30], cache=cache)
        for t in range(30, 40):
            logits = model(IDS[:, t : t + 1], cache=cache).logits
            assert torch.isfinite(logits).all()
            for layer in cache.layers:
                threshold = fields["threshold"]
                assert _below_threshold_outside(layer, getattr(layer, score), threshold, protected) == 0
    assert any(layer.store.length < 40 * 2 for layer in cache.layers)
