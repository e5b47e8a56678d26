"""Records say when a part of the policy did not act: a storage whose exact window held every kept token
(h2o over quant, quant on a text no longer than its window), and retrieval's ``full`` is exactly
1.0 against its reference, with ``cache_bytes`` filled and the params column showing effective values."""

from __future__ import annotations

import warnings

import pytest
from omegaconf import OmegaConf

from kvcompress.core.cache import make_policy
from kvcompress.harness.report import flatten, markdown_table
from kvcompress.harness.tasks import niah
from kvcompress.harness.tasks import perplexity as ppl_task
from kvcompress.metrics.reference import full_cache_bytes

TEXT = "The cat sat on the mat. A dog ran far away! Birds sing at dawn. Is it late? " * 8
QUANT_16 = {"name": "quant", "group_size": 4, "recent": 16, "key_axis": "token"}
H2O_OVER_QUANT = {"budget": 12, "compression_ratio": None, "storage": QUANT_16}


def _caught(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run()
    return got, [str(w.message) for w in caught]


def _ppl(llama, tok, tmp_path, policy, **params):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    cfg = OmegaConf.load("kvcompress/conf/task/perplexity.yaml")
    cfg.update(text=str(path), max_tokens=48, slices=1, speed=False, progress=False)
    return _caught(lambda: ppl_task.run(llama, tok, make_policy(policy, **params), cfg))


def _niah(llama, tok, tmp_path, policy, length=100, **params):
    path = tmp_path / "hay.txt"
    path.write_text(TEXT * 4)
    cfg = OmegaConf.load("kvcompress/conf/task/niah.yaml")
    cfg.update(text=str(path), lengths=[length], depths=[50], max_new_tokens=3, progress=False,
               needle="Magic is 42.", question="Magic?", answer="42", extra_needles=[])  # fmt: skip
    return _caught(lambda: niah.run(llama, tok, make_policy(policy, **params), cfg))


def test_h2o_keeping_fewer_tokens_than_quants_window_is_flagged(llama, char_tokenizer, tmp_path):
    got, warned = _ppl(llama, char_tokenizer, tmp_path, "h2o", **H2O_OVER_QUANT)
    assert got["compressed"] is True and got["storage_acted"] is False and got["storage_encoded_tokens"] == 0
    assert "exact window (recent=16)" in got["storage_warning"] and got["storage_warning"] in warned
    config = {"policy": {"_target_": "kvcompress.selectors.H2OPolicy", "budget": 12},
              "storage": {"_target_": "kvcompress.storage.QuantStorage", "recent": 16}}  # fmt: skip
    record = {"status": "ok", "policy_name": "h2o", "storage": "quant", "metrics": got, "config": config}
    row = flatten(record)
    assert row["params"] == "budget=12 storage.recent=16" and row["storage_acted"] is False
    header, _, line = markdown_table([row]).splitlines()
    assert "storage_acted" in header and "| False |" in line and "storage.recent=16" in line


def test_quant_on_a_text_inside_its_window_names_the_window_not_the_prefix(llama, char_tokenizer, tmp_path):
    """``sweep=quant_bits task.max_tokens=128``: recent=128 holds every token, so 2, 4 and 8 bits are one
    row; the warning says so instead of suggesting ``task.prefix_tokens``."""
    got, warned = _ppl(llama, char_tokenizer, tmp_path, "quant", group_size=4, recent=64)
    assert got["compressed"] is False and got["storage_acted"] is False
    assert "exact window (recent=64)" in got["warning"] and "task.prefix_tokens" not in got["warning"]
    assert [w for w in warned if "did not compress" in w] == [got["warning"]]
    acting, _ = _ppl(llama, char_tokenizer, tmp_path, "quant", group_size=4, recent=8)
    assert acting["compressed"] is True and acting["storage_acted"] is True and "warning" not in acting


def test_retrieval_full_is_exactly_its_own_reference_and_fills_cache_bytes(llama, char_tokenizer, tmp_path):
    """Past 128 tokens the decode steps grow full's buffers with headroom: against one prefill of the same
    tokens full read 1.005; against full fed the same way (prompt, then one token a forward) it is 1.0."""
    got, _ = _niah(llama, char_tokenizer, tmp_path, "full", length=300)
    case = got["cases"][0]
    assert case["cache_ratio"] == 1.0 and got["cache_ratio"] == 1.0
    assert got["cache_bytes"] == case["cache_bytes"] > 0
    fed = case["prompt_tokens"] + len(case["response"])  # the char tokenizer: one token a character
    assert case["cache_bytes"] == full_cache_bytes(llama, fed, prefill=case["context_tokens"])


def test_retrieval_flags_a_storage_that_encoded_nothing(llama, char_tokenizer, tmp_path):
    got, warned = _niah(llama, char_tokenizer, tmp_path, "h2o", **H2O_OVER_QUANT)
    assert got["compressed"] is True and got["storage_acted"] is False and got["storage_exact_window"] == 16
    assert "storage encoded no token in any of the 1 cases" in got["storage_warning"]
    assert got["storage_warning"] in warned


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ({"_target_": "kvcompress.selectors.SnapKVPolicy", "budget": None, "compression_ratio": None},
         "budget=None compression_ratio=0.5"),
        ({"_target_": "my_missing_plugin.Knorm", "compression_ratio": None}, "compression_ratio=None"),
    ],
)  # fmt: skip
def test_params_show_the_value_a_null_field_resolved_to(policy, expected):
    """snapkv's default ``compression_ratio: null`` is 0.5; a policy that cannot be built here shows as
    written."""
    assert flatten({"status": "ok", "config": {"policy": policy}, "metrics": {}})["params"] == expected
