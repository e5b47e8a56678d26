"""The lm-eval adapter says whether log-likelihood scoring and generation really compressed, and warns
(with what to set) when a compressing policy never acted, e.g. SnapKV under one-token streaming."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("lm_eval")
from kvcompress.eval.adapter import KVCompressLM  # noqa: E402

SNAP = {"policy": "snapkv", "budget": 12, "compression_ratio": None, "observation_window": 4}
SNAP["kernel_size"] = 3


def _lm(checkpoint, **args):
    return KVCompressLM(pretrained=str(checkpoint), device="cpu", **args)


def _compression(lm):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lm.compression()
    return result, [str(w.message) for w in caught if "did not compress" in str(w.message)]


IDS = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))


def test_snapkv_log_likelihoods_streamed_token_by_token_are_flagged(tiny_checkpoint):
    lm = _lm(tiny_checkpoint, chunk_size=1, **SNAP)
    lm._model_call(IDS)
    result, warned = _compression(lm)
    assert result["tokens_evicted"] == 0 and result["compressed"] is False
    assert "loglikelihood requests" in result["warning"] and "raise chunk_size" in result["warning"]
    assert warned == [result["warning"]]
    info = lm.get_model_info()["kvcompress"]  # what lm-eval stores in its results' config
    assert info["compressed"] is False and info["warning"] == result["warning"]
    assert info["loglikelihood"]["requests"] == 1 and info["generate"]["requests"] == 0


def test_snapkv_compresses_chunked_log_likelihoods_and_generation(tiny_checkpoint):
    lm = _lm(tiny_checkpoint, chunk_size=16, **SNAP)
    lm._model_call(IDS)
    result, warned = _compression(lm)
    assert result["tokens_evicted"] > 0 and result["compressed"] is True and warned == []
    gen = _lm(tiny_checkpoint, chunk_size=1, **SNAP)
    gen._model_generate(IDS, max_length=44, stop=[], do_sample=False)
    assert gen.compression()["compressed"] is True and gen.kvc_stats["generate"]["tokens_evicted"] > 0


def test_full_is_never_flagged_and_quant_counts_by_bytes(tiny_checkpoint):
    full = _lm(tiny_checkpoint, policy="full")
    full._model_call(IDS)
    result, warned = _compression(full)
    assert set(result.pop("attention_backends")) == {"sdpa"}  # full reads dense key/value through SDPA
    assert _removed(result) == 0.0  # nothing removed, overall, per layer and per (layer, KV head)
    assert result == {"tokens_evicted": 0, "read_ratio": 1.0, "compressed": False} and warned == []
    quant = _lm(tiny_checkpoint, policy="quant", bits=4, group_size=4, recent=8, chunk_size=1)
    quant._model_call(IDS)
    result, warned = _compression(quant)
    assert result.pop("attention_backends")  # which backends ran: the quant kernel where it builds
    assert _removed(result) == 0.0  # quant removes no token: it compresses by bytes
    assert result == {"tokens_evicted": 0, "read_ratio": 1.0, "compressed": True} and warned == []


def _removed(result: dict) -> float:
    """The largest effective compression ratio of a result (overall, per layer, per head), popped from it."""
    layers, heads = result.pop("effective_ratio_per_layer"), result.pop("effective_ratio_per_head")
    return max(result.pop("effective_compression_ratio"), *layers, *(r for h in heads for r in h))


def test_quest_log_likelihoods_are_compressed_by_what_they_read(tiny_checkpoint):
    """block_sparse keeps every token but reads fewer pages: compressed, not flagged as full's numbers."""
    lm = _lm(tiny_checkpoint, policy="block_sparse", block_size=4, top_k_blocks=2, chunk_size=1)
    lm._model_call(IDS)
    result, warned = _compression(lm)
    assert result["tokens_evicted"] == 0 and result["read_ratio"] < 0.7 and result["compressed"] is True
    assert warned == []


def test_no_request_yet_is_not_compressed_and_not_flagged(tiny_checkpoint):
    result, warned = _compression(_lm(tiny_checkpoint, **SNAP))
    expect = {"tokens_evicted": 0, "read_ratio": None, "compressed": False, "attention_backends": {}}
    assert result == expect and warned == []
