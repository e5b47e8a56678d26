"""Every bad input gets a clear error naming the field, the value and what is allowed (before model work)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from kvcompress import build_cache, load_model, load_text, make_policy
from kvcompress.harness.tasks.perplexity import text_tokens


class CharTokenizer:
    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 90 + 2 for c in text]]))


def _bert():
    cfg = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    return BertForMaskedLM(cfg)


def _text(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("only a few words")
    return str(path)


BAD = [
    (
        "unknown policy",
        lambda m, p: build_cache("nope", m),
        "policy='nope' is unknown; known policies: .*quant",
    ),
    ("unknown field", lambda m, p: make_policy("quant", bitz=4), "no field.*bitz.*bits"),
    ("bits 3", lambda m, p: make_policy("quant", bits=3), r"quant.bits=3 .*allowed: \[2, 4, 8\]"),
    (
        "group size",
        lambda m, p: build_cache("quant", m, group_size=5),
        "group_size=5 must divide head_dim=16",
    ),
    (
        "window 0",
        lambda m, p: make_policy("sliding_window", window=0),
        "sliding_window.window=0 must be an integer >= 1",
    ),
    (
        "h2o budget < recent",
        lambda m, p: make_policy("h2o", budget=4, compression_ratio=None, recent=8),
        "h2o.budget=4 is below recent=8",
    ),
    (
        "budget and ratio",
        lambda m, p: make_policy("tova", budget=8, compression_ratio=0.5),
        "exactly one of budget",
    ),
    (
        "ratio 1.2",
        lambda m, p: make_policy("tova", compression_ratio=1.2),
        r"compression_ratio=1.2 must be in \[0, 1\)",
    ),
    (
        "rank > head_dim",
        lambda m, p: build_cache("low_rank", m, rank=100, calibration_text="random"),
        r"low_rank.rank=100 must be in \[1, head_dim=16\]",
    ),
    ("block size", lambda m, p: make_policy("block_sparse", block_size=0), "block_sparse.block_size=0"),
    (
        "block_evict budget below protected blocks",
        lambda m, p: make_policy("block_evict", budget=96),
        r"block_evict.budget=96 is below 128 = \(sink blocks 1 \+ recent blocks 2 \+ 1\) x block_size=32",
    ),
    (
        "block_evict budget and compression_ratio",
        lambda m, p: make_policy("block_evict", budget=512, compression_ratio=0.5),
        "block_evict: set exactly one of budget .* got budget=512, compression_ratio=0.5",
    ),
    (
        "block_evict keep_ratio (removed)",
        lambda m, p: make_policy("block_evict", keep_ratio=0.5),
        r"block_evict.keep_ratio was removed: use compression_ratio",
    ),
    (
        "block_evict block_size 0",
        lambda m, p: make_policy("block_evict", block_size=0),
        "block_evict.block_size=0 must be an integer >= 1",
    ),
    (
        "schedule layer",
        lambda m, p: build_cache(
            "window_schedule",
            m,
            rules=[{"layers": "2-5", "policy": {"_target_": "kvcompress.selectors.FullPolicy"}}],
        ),
        r"names layer\(s\) \[3, 4, 5\]; the model has 3 layers",
    ),
    (
        "text too short",
        lambda m, p: text_tokens(CharTokenizer(), p, 500),
        "max_tokens=500: text .* has only 16 tokens",
    ),
    (
        "context too long",
        lambda m, p: text_tokens(CharTokenizer(), p, 9000, max_positions=8192),
        "max_tokens=9000 exceeds the model's context of 8192",
    ),
    ("non-decoder model", lambda m, p: build_cache("full", _bert()), "not a decoder-only causal LM"),
    (
        "missing model path",
        lambda m, p: load_model("/no/such/model"),
        "local path /no/such/model does not exist",
    ),
    (
        "missing gguf",
        lambda m, p: load_model("/no/such/model.gguf"),
        "GGUF file /no/such/model.gguf does not exist",
    ),
    (
        "missing text file",
        lambda m, p: load_text("/no/such/text.txt"),
        "file /no/such/text.txt does not exist",
    ),
    ("bad dtype", lambda m, p: load_model("x", dtype="int3"), "dtype='int3' is not supported; allowed"),
]


@pytest.mark.parametrize("case,call,message", BAD, ids=[row[0] for row in BAD])
def test_bad_input_is_refused_clearly(case, call, message, llama, tmp_path):
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        call(llama, _text(tmp_path))
    assert err.match(message)


def test_unknown_task_lists_known_ones(tmp_path):
    cmd = [sys.executable, "-m", "kvcompress", "task=nope", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "nope" in proc.stderr and "perplexity" in proc.stderr  # Hydra lists the available tasks
