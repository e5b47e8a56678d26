"""Every ``decode_perplexity`` result says whether the policy acted, and warns with the cause when it did not:
a prefill-only selector gets a prefix by default, KVzip its context pass; an exact window that holds every
kept token, a context pass not run and a budget that covers the text are named."""

from __future__ import annotations

import warnings

import pytest

from kvcompress import build_cache
from kvcompress.metrics import decode_perplexity

SNAP = {"budget": None, "compression_ratio": 0.5, "observation_window": 4}
KVZIP = {"budget": 12, "compression_ratio": None, "context_chunk": 16, "budget_scope": "layer"}


def _measure(model, ids, name, fields=None, **kwargs):
    """(result, warning messages) of ``decode_perplexity`` over a fresh ``name`` cache."""
    cache = build_cache(name, model, **(fields or {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = decode_perplexity(model, ids, cache, progress=False, **kwargs)
    flags = ("did not compress", "encoded no token", "observation window")
    return got, [str(w.message) for w in caught if any(f in str(w.message) for f in flags)]


def test_full_says_it_kept_everything_and_never_warns(llama, tokens):
    got, warned = _measure(llama, tokens, "full")
    assert got["prefix_tokens"] is None and got["tokens_scored"] == 47
    assert got["tokens_evicted"] == 0 and got["compressed"] is False and got["cache_ratio"] == 1.0
    assert "warning" not in got and warned == []


def test_snapkv_gets_half_the_text_as_its_prefix_by_default(llama, tokens):
    got, warned = _measure(llama, tokens, "snapkv", SNAP)
    assert got["prefix_tokens"] == 24 and got["tokens_scored"] == 48 - 24 - 1
    assert got["compressed"] is True and got["tokens_evicted"] == 3 * 12  # 24 -> 12 in each of 3 layers
    assert got["cache_ratio"] < 1.0 and "warning" not in got and warned == []


def test_snapkv_streamed_without_a_prefix_is_flagged_with_its_cause(llama, tokens):
    got, warned = _measure(llama, tokens, "snapkv", SNAP, prefix_tokens=None)
    full, _ = _measure(llama, tokens, "full")
    assert got["perplexity"] == pytest.approx(full["perplexity"], rel=1e-5)  # full's numbers, and it says so
    assert got["compressed"] is False and got["tokens_evicted"] == 0 and got["cache_ratio"] == 1.0
    assert "only a forward of several tokens" in got["warning"] and "prefix_tokens=N" in got["warning"]
    assert warned == [got["warning"]]


def test_kvzip_runs_its_context_pass_after_the_default_prefix(llama, tokens):
    got, warned = _measure(llama, tokens, "kvzip", KVZIP)
    assert got["prefix_tokens"] == 24 and got["compressed"] is True
    assert got["tokens_evicted"] == 3 * (24 - 12) and warned == []


def test_kvzip_whose_context_pass_did_not_run_is_flagged(llama, tokens):
    got, warned = _measure(llama, tokens, "kvzip", KVZIP, prefix_tokens=24, after_prefix=lambda c, i: None)
    assert got["compressed"] is False and "context pass after a prefill, and none ran" in got["warning"]
    streamed, warned = _measure(llama, tokens, "kvzip", KVZIP, prefix_tokens=None)
    assert (
        streamed["compressed"] is False
        and "context pass after a prefill, and none ran" in streamed["warning"]
    )
    assert warned == [streamed["warning"]]


def test_a_budget_that_covers_the_prefix_is_named(llama, tokens):
    got, warned = _measure(llama, tokens, "snapkv", {**SNAP, "budget": 40, "compression_ratio": None})
    assert got["compressed"] is False and "lower the policy's budget" in got["warning"] and len(warned) == 1


def test_quant_whose_exact_window_holds_every_token_names_the_window(llama, tokens):
    """quant alone with recent=64 on 47 tokens: nothing quantized, full's numbers; the cause is the window."""
    got, warned = _measure(llama, tokens, "quant", {"group_size": 4, "recent": 64})
    assert got["compressed"] is False and got["storage_acted"] is False and got["storage_encoded_tokens"] == 0
    assert "exact window (recent=64)" in got["warning"] and "no layer held more than 47" in got["warning"]
    assert len(warned) == 1  # one warning, with the cause: not a second one for the storage
    small, warned = _measure(llama, tokens, "quant", {"group_size": 4, "recent": 8})
    assert small["compressed"] is True and small["storage_acted"] is True and warned == []
    assert small["storage_encoded_tokens"] > 0 and "storage_warning" not in small


def test_a_selector_keeping_fewer_tokens_than_the_exact_window_flags_the_storage(llama, tokens):
    """h2o keeps 12 tokens over quant's 16-token exact window: h2o compressed, the storage never did."""
    fields = {"budget": 12, "compression_ratio": None, "storage": {"name": "quant", "group_size": 4,
              "recent": 16, "key_axis": "token"}}  # fmt: skip
    got, warned = _measure(llama, tokens, "h2o", fields)
    assert got["compressed"] is True and got["tokens_evicted"] > 0 and "warning" not in got
    assert got["storage_acted"] is False and got["storage_exact_window"] == 16
    assert "(h2o keeps at most that many)" in got["storage_warning"] and warned == [got["storage_warning"]]


def test_a_snapkv_forward_shorter_than_its_window_is_flagged(llama, tokens):
    """A 6-token prefix with a 32-token observation window: the window is cut, and the result says so."""
    got, warned = _measure(llama, tokens, "snapkv", {"compression_ratio": 0.5}, prefix_tokens=6)
    assert got["observation_window_cut"] == 3  # one compression per layer, each with a cut window
    assert "observation window (32)" in got["window_warning"] and warned == [got["window_warning"]]
    fine, _ = _measure(llama, tokens, "snapkv", SNAP)  # window 4 < prefix 24 and budget 12
    assert "observation_window_cut" not in fine


def test_a_window_that_covers_the_text_is_named_with_the_api_arguments(llama, tokens):
    """The same cause as the command line's, in ``decode_perplexity``'s terms (no ``task.`` names)."""
    got, warned = _measure(llama, tokens, "sliding_window", {"window": 60}, prefix_tokens=None)
    assert got["compressed"] is False and warned == [got["warning"]]
    assert "budget covers every token" in got["warning"] and "below the streamed tokens" in got["warning"]
    assert "task." not in got["warning"]
