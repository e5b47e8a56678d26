"""multi_niah on a tiny model with a character tokenizer: needles, both modes, tables, compression flags."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from kvcompress import build_cache
from kvcompress.harness.tasks import multi_niah
from kvcompress.harness.tasks.conversation import next_turn_text
from kvcompress.harness.tasks.retrieval import answer, eos_ids, split_prompt

TEXT = "The cat sat. A dog ran far away! Birds sing at dawn. Is it late? " * 30


def cfg_for(tmp_path, **over):
    path = tmp_path / "hay.txt"
    path.write_text(TEXT)
    cfg = OmegaConf.load("kvcompress/conf/task/multi_niah.yaml")
    cfg.update(
        text=str(path), lengths=[300], needle_keys=["Rome", "Oslo", "Lima"], max_new_tokens=3, progress=False
    )
    cfg.update(needle="{key}={value}.", question="{key}?", answer_prefix="{key}=", digits=2, **over)
    return cfg


def test_needles_sit_at_their_depths_in_order(char_tokenizer, tmp_path):
    cfg = cfg_for(tmp_path)
    ctx = multi_niah.make_context(char_tokenizer, cfg, 300, 0)
    text = ctx["context"]
    spots = [text.index(f"{k}={v}.") for k, v in zip(cfg.needle_keys, ctx["values"], strict=True)]
    assert spots[0] == 0 and spots == sorted(spots) and text.endswith(f"Lima={ctx['values'][2]}.")
    assert (
        100 <= spots[1] <= 200 and ctx["depths"] == [0.0, 50.0, 100.0] and sorted(ctx["order"]) == [0, 1, 2]
    )
    with pytest.raises(ValueError, match="one depth in"):
        multi_niah.depths_for(cfg_for(tmp_path, depths=[0, 50]))


def test_independent_questions_each_see_exactly_the_context(llama, char_tokenizer, tmp_path):
    cfg = cfg_for(tmp_path)
    got = multi_niah.run(
        llama, char_tokenizer, build_cache("full", llama).policy, cfg, out_dir=tmp_path / "o"
    )
    ctx = multi_niah.make_context(char_tokenizer, cfg, 300, 0)
    for case in got["cases"]:  # the same answer as a fresh cache asked only this question
        head, tail = split_prompt(char_tokenizer, ctx["context"], f"{case['key']}?", True, f"{case['key']}=")
        ids = answer(llama, build_cache("full", llama), head, tail, False, 3, eos_ids(llama, char_tokenizer))
        assert case["response"] == char_tokenizer.decode(ids)
    assert [c["turn"] for c in got["cases"]] == [0, 1, 2] and got["cases_total"] == 3
    assert set(got["per_depth"]) == {"0.0", "50.0", "100.0"} and set(got["per_turn"]) == {"0", "1", "2"}
    assert set(got["per_key"]) == {"Rome", "Oslo", "Lima"} and got["compressed"] is False
    assert "| depth % | accuracy |" in (tmp_path / "o" / "multi_niah_tables.md").read_text()


def test_multiturn_keeps_the_history(llama, char_tokenizer, tmp_path):
    cfg = cfg_for(tmp_path, mode="multiturn")
    got = multi_niah.run(llama, char_tokenizer, build_cache("full", llama).policy, cfg)
    ctx = multi_niah.make_context(char_tokenizer, cfg, 300, 0)
    keys = [cfg.needle_keys[i] for i in ctx["order"]]
    head, tail = split_prompt(char_tokenizer, ctx["context"], f"{keys[0]}?", True, f"{keys[0]}=")
    cache, stop = build_cache("full", llama), eos_ids(llama, char_tokenizer)
    first = answer(llama, cache, head, tail, False, 3, stop)
    assert got["cases"][0]["response"] == char_tokenizer.decode(first)
    nxt = next_turn_text(char_tokenizer, f"{keys[1]}?", f"{keys[1]}=", True)
    assert nxt.startswith("\n[user] " + keys[1]) and nxt.endswith(f"[assistant] {keys[1]}=")
    ids = char_tokenizer(nxt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = None
        for i in range(ids.shape[1]):
            logits = llama(ids[:, i : i + 1], cache=cache).logits
    second = [int(logits[0, -1].argmax())]  # the first token of the second answer, with history
    assert char_tokenizer.decode(second) == got["cases"][1]["response"][:1]


def test_kvzip_compresses_each_context_once_and_a_bad_mode_is_named(llama, char_tokenizer, tmp_path):
    from kvcompress.selectors import KVzipPolicy

    policy = KVzipPolicy(**KVzipPolicy.TEST_PARAMS)
    got = multi_niah.run(llama, char_tokenizer, policy, cfg_for(tmp_path, trials=2))
    assert got["compressed"] is True and got["cases_total"] == 6
    assert all(c["tokens_evicted"] == 3 * (c["context_tokens"] - 12) for c in got["cases"])
    with pytest.raises(ValueError, match=r"task.mode='chat' is not supported; allowed: \['independent'"):
        multi_niah.run(llama, char_tokenizer, policy, cfg_for(tmp_path, mode="chat"))
