"""No silent no-ops: prefix perplexity scores only the streamed continuation, and every perplexity and
retrieval result says whether the policy really compressed (``tokens_evicted``, ``compressed``), with a
warning that says what to set when a compressing policy never acted."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from kvcompress import build_cache
from kvcompress.core.cache import make_policy
from kvcompress.harness.report import flatten, markdown_table
from kvcompress.harness.tasks import niah
from kvcompress.harness.tasks import perplexity as ppl_task
from kvcompress.metrics import decode_perplexity
from kvcompress.selectors import QuantPolicy, SnapKVPolicy

TEXT = "The cat sat on the mat. A dog ran far away! Birds sing at dawn. Is it late? " * 8


def _ppl_cfg(tmp_path, **over):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    cfg = OmegaConf.load("kvcompress/conf/task/perplexity.yaml")
    cfg.update(text=str(path), max_tokens=48, slices=1, speed=False, progress=False, **over)
    return cfg


def _run_task(llama, char_tokenizer, cfg, policy, **params):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = ppl_task.run(llama, char_tokenizer, make_policy(policy, **params), cfg)
    return metrics, [str(w.message) for w in caught if "did not compress" in str(w.message)]


def test_prefix_perplexity_scores_only_the_streamed_tokens(llama, tokens):
    n, prefix = tokens.shape[1], 30
    got = decode_perplexity(llama, tokens, build_cache("full", llama), chunk_size=4, progress=False,
                            prefix_tokens=prefix)  # fmt: skip
    assert (
        got["tokens_scored"] == n - prefix - 1 and got["prefix_tokens"] == prefix and got["chunk_size"] == 4
    )
    with torch.inference_mode():  # uncompressed, prefix + streaming is one forward's scores on the tail
        logits = llama(tokens).logits[0, prefix:-1].float()
    nll = F.cross_entropy(logits, tokens[0, prefix + 1 :]).item()
    assert got["nll"] == pytest.approx(nll, rel=1e-5) and got["perplexity"] == pytest.approx(math.exp(nll))
    plain = decode_perplexity(llama, tokens, build_cache("full", llama), progress=False)
    assert plain["tokens_scored"] == n - 1 and plain["prefix_tokens"] is None


@pytest.mark.parametrize("bad", [0, 47, 100, 2.5, True, "8"])
def test_bad_prefix_tokens_name_the_allowed_range(llama, tokens, bad):
    with pytest.raises(ValueError, match=r"prefix_tokens=.* must be null or an integer in \[1, 46\]"):
        decode_perplexity(llama, tokens, build_cache("full", llama), progress=False, prefix_tokens=bad)


def test_snapkv_compresses_a_prefix_and_is_flagged_under_one_token_streaming(llama, char_tokenizer, tmp_path):
    snap = SnapKVPolicy.TEST_PARAMS | {"slack": None, "evict_at": "prefill"}
    prefix, _ = _run_task(llama, char_tokenizer, _ppl_cfg(tmp_path, prefix_tokens=32), "snapkv", **snap)
    assert prefix["tokens_evicted"] > 0 and prefix["compressed"] is True and "warning" not in prefix
    assert prefix["tokens_scored"] == 48 - 32 - 1 and prefix["prefix_tokens"] == 32
    assert prefix["cache_ratio"] < 1.0
    streamed, warned = _run_task(llama, char_tokenizer, _ppl_cfg(tmp_path), "snapkv", **snap)
    assert streamed["tokens_evicted"] == 0 and streamed["compressed"] is False
    assert "task.prefix_tokens" in streamed["warning"] and "chunk_size=1" in streamed["warning"]
    assert warned == [streamed["warning"]]
    row = flatten({"status": "ok", "config": {"policy": {"_target_": "x.SnapKVPolicy"}}, "metrics": streamed})
    table = markdown_table([row])
    assert "compressed" in table.splitlines()[0] and "| False |" in table


def test_a_window_covering_the_text_is_named_as_the_cause_not_a_prefix(llama, char_tokenizer, tmp_path):
    """sliding_window acts at every step: when it never evicted, the cause is its window, not a missing
    prefill, and the warning names the budget, never task.prefix_tokens."""
    got, warned = _run_task(llama, char_tokenizer, _ppl_cfg(tmp_path), "sliding_window", window=60)
    assert got["compressed"] is False and warned == [got["warning"]]
    assert "budget covers every token" in got["warning"] and "task.max_tokens=48" in got["warning"]
    assert "prefix_tokens" not in got["warning"]


def test_full_is_never_flagged_and_quant_counts_by_bytes(llama, char_tokenizer, tmp_path):
    full, warned = _run_task(llama, char_tokenizer, _ppl_cfg(tmp_path), "full")
    assert full["compressed"] is False and full["tokens_evicted"] == 0 and "warning" not in full
    assert warned == [] and full["cache_ratio"] == pytest.approx(1.0)
    quant, warned = _run_task(llama, char_tokenizer, _ppl_cfg(tmp_path), "quant", **QuantPolicy.TEST_PARAMS)
    assert quant["tokens_evicted"] == 0 and quant["compressed"] is True and warned == []


def test_quest_reading_fewer_pages_is_compressed_by_its_read_ratio(llama, char_tokenizer, tmp_path):
    """block_sparse stores every token (and page bounds: more bytes than full) but reads fewer: its logits
    are not full's, so it is compressed by ``read_ratio``, never flagged as "those numbers are full's"."""
    got, warned = _run_task(llama, char_tokenizer, _ppl_cfg(tmp_path), "block_sparse", block_size=4,
                            top_k_blocks=2)  # fmt: skip
    assert got["tokens_evicted"] == 0 and got["cache_ratio"] > 1.0 and got["read_ratio"] < 0.7
    assert got["compressed"] is True and "warning" not in got and warned == []
    full, _ = _run_task(llama, char_tokenizer, _ppl_cfg(tmp_path), "full")
    assert full["read_ratio"] == 1.0 and got["perplexity"] != full["perplexity"]


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen2"])
def test_full_reads_everything_the_model_reads_on_windowed_families(family):
    """``read_ratio`` compares with the model's own attention: ``full`` on a windowed model is exactly 1
    (its window is the model's semantics) token by token and in chunks; a sliding window inside the model's
    below 1 (each step's last query counts)."""
    from helpers import stream_logits
    from zoo import make_family

    from kvcompress.metrics.compression import read_ratio

    model = make_family(family)
    ids = torch.randint(2, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    for chunk in (1, 7):
        cache = build_cache("full", model)
        stream_logits(model, ids, cache, chunk)
        assert read_ratio(cache) == 1.0
    window = build_cache("sliding_window", model, window=8, sink_tokens=2, apply_to="all")
    stream_logits(model, ids, window, 1)
    assert read_ratio(window) < 1.0


def test_a_budget_that_covers_the_text_is_flagged(llama, char_tokenizer, tmp_path):
    cfg = _ppl_cfg(tmp_path, prefix_tokens=32)
    got, warned = _run_task(llama, char_tokenizer, cfg, "sliding_window", sink_tokens=2, window=64)
    assert got["compressed"] is False and "task.prefix_tokens=32" in got["warning"] and len(warned) == 1


def _niah_cfg(tmp_path):
    path = tmp_path / "hay.txt"
    path.write_text(TEXT * 2)
    cfg = OmegaConf.load("kvcompress/conf/task/niah.yaml")
    cfg.update(text=str(path), lengths=[100], depths=[50], max_new_tokens=3, progress=False)
    cfg.update(
        needle="Magic is 42.", question="Magic?", answer="42", question_in_prompt=True, extra_needles=[]
    )
    return cfg


@pytest.mark.parametrize(
    ("policy", "params", "compressed", "flagged"),
    [
        ("full", {}, False, False),
        ("snapkv", SnapKVPolicy.TEST_PARAMS, True, False),
        ("quant", QuantPolicy.TEST_PARAMS, True, False),
        ("block_sparse", {"block_size": 4, "top_k_blocks": 2}, True, False),
        ("snapkv", {"budget": 500, "compression_ratio": None}, False, True),
    ],
)
def test_retrieval_records_whether_each_case_compressed(
    llama, char_tokenizer, tmp_path, policy, params, compressed, flagged
):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = niah.run(llama, char_tokenizer, make_policy(policy, **params), _niah_cfg(tmp_path))
    case = m["cases"][0]
    assert case["compressed"] is compressed and m["compressed"] is compressed
    evicts = policy == "snapkv" and compressed
    reads_fewer = policy == "block_sparse" or evicts  # Quest's pages; an evicted token is not read either
    assert (case["read_ratio"] < 1.0) == reads_fewer and m["read_ratio"] == case["read_ratio"]
    assert m["cache_ratio"] == case["cache_ratio"] and (case["cache_ratio"] < 1.0) == (
        policy in ("quant", "snapkv") and compressed
    )
    assert m["tokens_evicted"] == case["tokens_evicted"] and (case["tokens_evicted"] > 0) == evicts
    assert ("warning" in m) is flagged and any(
        "did not compress" in str(w.message) for w in caught
    ) is flagged
    if flagged:
        assert "1 of 1 cases (lengths [100]" in m["warning"] and "lower it below" in m["warning"]
