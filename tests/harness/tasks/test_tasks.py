"""Retrieval tasks (niah, passkey) on a tiny model with a character tokenizer: prompts, modes, records."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from kvcompress import build_cache
from kvcompress.harness.tasks import niah, passkey
from kvcompress.harness.tasks.grid import accuracy_table, table_markdown
from kvcompress.harness.tasks.retrieval import answer, is_correct, split_prompt

TEXT = "The cat sat. A dog ran far away! Birds sing at dawn. Is it late? " * 20


def niah_cfg(tmp_path, **over):
    path = tmp_path / "hay.txt"
    path.write_text(TEXT)
    base = OmegaConf.load("kvcompress/conf/task/niah.yaml")
    base.update(text=str(path), lengths=[80, 120], depths=[0, 50, 100], max_new_tokens=4, progress=False)
    base.update(needle="Magic is 42.", question="Magic?", answer="42", extra_needles=[], **over)
    return base


def test_needle_sits_at_a_sentence_boundary_near_its_depth(char_tokenizer):
    hay = tuple(char_tokenizer(TEXT[:200], add_special_tokens=False).input_ids)
    text, pos = niah.insert_needle(char_tokenizer, hay, "NEEDLE.", 50.0)
    assert text.count("NEEDLE.") == 1 and pos == text.index("NEEDLE.") - 1  # one token per character
    assert text[:pos].rstrip().endswith((".", "!", "?")) and 80 <= pos <= 100
    assert niah.insert_needle(char_tokenizer, hay, "NEEDLE.", 0.0)[0].startswith("NEEDLE.")
    assert niah.insert_needle(char_tokenizer, hay, "NEEDLE.", 100.0)[0].endswith("NEEDLE.")
    with pytest.raises(ValueError, match="depth=120"):
        niah.insert_needle(char_tokenizer, hay, "NEEDLE.", 120.0)


@pytest.mark.parametrize("chat", [True, False])
def test_prompt_splits_right_after_the_context(char_tokenizer, chat):
    head, tail = split_prompt(char_tokenizer, "CONTEXT", "Q?", chat, answer_prefix="A:")
    head_s, tail_s = char_tokenizer.decode(head[0]), char_tokenizer.decode(tail[0])
    assert head_s.endswith("CONTEXT") and "Q?" in tail_s and tail_s.endswith("A:")
    assert head_s.startswith("[user]" if chat else "CONTEXT")


def test_answer_stops_on_the_stop_ids(llama, char_tokenizer):
    head, tail = split_prompt(char_tokenizer, "abc def", "x?", chat=False)
    first = answer(llama, build_cache("full", llama), head, tail, True, 5, stop=set())
    assert len(first) == 5
    assert answer(llama, build_cache("full", llama), head, tail, True, 5, stop={first[0]}) == []
    cut = first.index(first[-1])  # the greedy run up to the first occurrence of a stop id
    assert answer(llama, build_cache("full", llama), head, tail, False, 5, stop={first[-1]}) == first[:cut]


def test_exact_match_ignores_case_punctuation_and_spaces():
    assert is_correct("The special magic number is 7,392.", "7392")
    assert is_correct("It is  Dolores\nPARK!", "dolores park")
    assert not is_correct("73920", "7392") and not is_correct("739", "7392") and not is_correct("", "7392")


def test_niah_grid_records_table_files_and_same_answers_in_both_modes_when_uncompressed(
    llama, char_tokenizer, tmp_path
):
    runs = {}
    for mode in (True, False):
        out = tmp_path / f"q{mode}"
        cfg = niah_cfg(tmp_path, question_in_prompt=mode)
        runs[mode] = niah.run(llama, char_tokenizer, build_cache("full", llama).policy, cfg, out_dir=out)
    m = runs[False]
    assert (
        m["cases_total"] == 6
        and len(m["cases"]) == 6
        and m["correct"] == sum(c["correct"] for c in m["cases"])
    )
    assert set(m["table"]) == {"0.0", "50.0", "100.0"} and set(m["table"]["50.0"]) == {"80", "120"}
    records = [
        json.loads(line) for line in (tmp_path / "qFalse" / "niah_cases.jsonl").read_text().splitlines()
    ]
    assert records == m["cases"] and (tmp_path / "qFalse" / "niah_table.md").exists()
    assert m["heatmap"] and (tmp_path / "qFalse" / "niah_heatmap.png").stat().st_size > 0
    assert [c["context_tokens"] for c in m["cases"]][:3] == [
        c["context_tokens"] for c in runs[True]["cases"]
    ][:3]
    # uncompressed, the question chunk and the question token by token are the same computation
    assert [c["response"] for c in runs[True]["cases"]] == [c["response"] for c in m["cases"]]


def test_compressed_cases_keep_fewer_tokens(llama, char_tokenizer, tmp_path):
    from kvcompress.selectors import SnapKVPolicy

    cfg = niah_cfg(tmp_path, question_in_prompt=True, lengths=[120], depths=[50])
    full = niah.run(llama, char_tokenizer, build_cache("full", llama).policy, cfg)["cases"][0]
    snap_policy = SnapKVPolicy(compression_ratio=0.5, observation_window=8)
    snap = niah.run(llama, char_tokenizer, snap_policy, cfg)["cases"][0]
    assert snap["prompt_tokens"] == full["prompt_tokens"]
    assert snap["tokens_stored_mean"] < 0.55 * full["tokens_stored_mean"]
    assert snap["cache_bytes"] < 0.55 * full["cache_bytes"]


def test_passkey_hides_a_seeded_number_at_its_depth(char_tokenizer):
    cfg = OmegaConf.load("kvcompress/conf/task/passkey.yaml")
    cases = [passkey.make_case(char_tokenizer, cfg, 900, d) for d in (0.0, 50.0, 100.0)]
    for case in cases:
        assert len(case.answer) == cfg.digits and case.context.count(case.answer) == 2
        assert 800 <= len(char_tokenizer(case.context).input_ids) <= 900
    assert [c.fact_token for c in cases] == sorted(c.fact_token for c in cases)
    assert cases[1].fact_token == pytest.approx(450, abs=100)
    assert passkey.make_case(char_tokenizer, cfg, 900, 50.0).answer == cases[1].answer  # seeded
    with pytest.raises(ValueError, match="length=100"):
        passkey.make_case(char_tokenizer, cfg, 100, 50.0)


def test_table_markdown_lists_depths_by_lengths():
    cases = [
        {"depth": d, "length": n, "correct": c} for d, n, c in [(0, 1, True), (0, 1, False), (50, 2, True)]
    ]
    table = accuracy_table(cases)
    assert table == {0: {1: 0.5}, 50: {2: 1.0}}
    assert "| 0 | 0.50 |  |" in table_markdown(table)
