"""task.batch_size for niah, passkey and multi_niah: the same answers and scores as one case at a time,
in both question modes and under eviction; a policy that cannot serve padded rows is refused by the field."""

from __future__ import annotations

import pytest
from test_multi_niah import cfg_for
from test_tasks import niah_cfg

from kvcompress import make_policy
from kvcompress.harness.tasks import multi_niah, niah
from kvcompress.harness.tasks.batched import batches

# what a batch's slots change: padding slots are stored, read and counted (the effective ratios too: tokens
# removed over tokens seen, padding slots included)
CACHE_FIELDS = ("tokens_stored_mean", "cache_bytes", "cache_ratio", "read_ratio", "tokens_evicted",
                "compressed", "batch_rows", "attention_backends", "effective_compression_ratio",
                "effective_ratio_per_layer", "effective_ratio_per_head")  # fmt: skip


def _answers(metrics: dict) -> list[dict]:
    return [{k: v for k, v in c.items() if k not in CACHE_FIELDS} for c in metrics["cases"]]


@pytest.mark.parametrize("question_in_prompt", [True, False])
@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_batched_niah_equals_one_case_at_a_time(llama, char_tokenizer, tmp_path, policy, question_in_prompt):
    pol = make_policy(policy, **({"budget": 40} if policy == "h2o" else {}))
    runs = {}
    for size in (1, 4):
        cfg = niah_cfg(tmp_path, question_in_prompt=question_in_prompt, batch_size=size, max_new_tokens=6)
        runs[size] = niah.run(llama, char_tokenizer, pol, cfg)
    assert _answers(runs[4]) == _answers(runs[1]) and runs[4]["accuracy"] == runs[1]["accuracy"]
    assert len({c["prompt_tokens"] for c in runs[4]["cases"]}) > 1  # rows of different lengths: padded
    assert {c["batch_rows"] for c in runs[4]["cases"]} == {4, 2}  # 6 cases: a batch of 4, one of 2
    if policy == "h2o":
        assert all(c["tokens_evicted"] > 0 for c in runs[4]["cases"]) and runs[4]["compressed"]


def test_batch_size_is_validated_and_an_inexact_policy_refused_by_name(llama, char_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="task.batch_size=0"):
        niah.run(llama, char_tokenizer, make_policy("full"), niah_cfg(tmp_path, batch_size=0))
    quant = make_policy("quant", group_size=8)
    same = niah.run(llama, char_tokenizer, quant, niah_cfg(tmp_path, batch_size=3))  # equal lengths: no pad
    assert _answers(same) == _answers(niah.run(llama, char_tokenizer, quant, niah_cfg(tmp_path)))
    with pytest.raises(ValueError, match="Set task.batch_size=1"):  # lengths 80 and 120 in one batch
        niah.run(llama, char_tokenizer, quant, niah_cfg(tmp_path, batch_size=4))


def test_batches_group_equal_keys_in_order():
    assert batches([5, 7, 5, 5, 7], 2) == [[0, 2], [3], [1, 4]]


@pytest.mark.parametrize("policy", ["full", "sliding_window"])
def test_batched_multi_niah_equals_one_context_at_a_time(llama, char_tokenizer, tmp_path, policy):
    pol = make_policy(policy, **({"sink_tokens": 4, "window": 64} if policy != "full" else {}))
    runs = {}
    for size in (1, 3):
        cfg = cfg_for(tmp_path, lengths=[300, 260], trials=2, batch_size=size)
        runs[size] = multi_niah.run(llama, char_tokenizer, pol, cfg)
    assert _answers(runs[3]) == _answers(runs[1]) and runs[3]["per_turn"] == runs[1]["per_turn"]
    assert {c["batch_rows"] for c in runs[3]["cases"]} == {3, 1}  # four contexts of two lengths
    assert runs[3]["compressed"] == (policy != "full")
    with pytest.raises(ValueError, match="task.mode=independent"):
        multi_niah.run(llama, char_tokenizer, pol, cfg_for(tmp_path, mode="multiturn", batch_size=2))


def test_a_batch_cache_reports_every_byte_field_per_row(llama):
    """Two identical rows share one tiered cache: its bytes per tier and traffic are shared out per row, as
    ``cache_bytes`` is, so each equals the numbers of the row alone (none is the batch's total)."""
    import torch

    from kvcompress.core.cache import build_cache
    from kvcompress.harness.tasks.retrieval import TIER_BYTES, cache_fields

    policy = make_policy(
        "tiered", top_k_blocks=2, storage={"name": "offload", "block_size": 4, "recent": 8, "lru_pages": 3}
    )
    ids = torch.randint(0, llama.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    fields = {}
    for rows in (1, 2):
        cache = build_cache(policy, llama)
        with torch.inference_mode():
            llama(ids.expand(rows, -1), cache=cache, use_cache=True)
            llama(ids[:, -1:].expand(rows, -1), cache=cache, use_cache=True)
        fields[rows] = cache_fields(llama, policy, cache, rows)
    assert fields[1]["device_bytes"] > 0 and fields[1]["bytes_fetched_per_step"] > 0
    for key in ("cache_bytes", *TIER_BYTES):
        assert fields[2][key] == pytest.approx(fields[1][key]), key
