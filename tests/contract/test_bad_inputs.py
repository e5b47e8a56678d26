"""Every bad input gets a clear error naming the field, the value and what is allowed (before model work).

A policy's or storage's own fields are refused from their declarations (``test_declared_fields``), rules
across its fields in its own tests (``tests/selectors``, ``tests/storage``); here: names, files, models, texts
and lengths."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from kvcompress import build_cache, known_policies, load_model, load_text, make_policy
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


@pytest.mark.parametrize("name", known_policies())
def test_an_unknown_field_is_refused_naming_the_known_ones(name):
    """Every registered policy (its own fields' bad values: ``test_declared_fields``; rules across fields:
    each method's own tests under ``tests/selectors`` and ``tests/storage``)."""
    with pytest.raises(ValueError, match=rf"policy '{name}' has no field\(s\) \['bitz'\]; fields: \["):
        make_policy(name, bitz=4)


def test_unknown_task_lists_known_ones(tmp_path):
    cmd = [sys.executable, "-m", "kvcompress", "task=nope", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "nope" in proc.stderr and "perplexity" in proc.stderr  # Hydra lists the available tasks
