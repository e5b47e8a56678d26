"""Long-value needles: values of 5-8 digits and UUID-like strings, their token positions, and a case run."""

from __future__ import annotations

import random
import re

import pytest
import torch

from kvcompress import make_policy
from kvcompress.harness.tasks import long_values as lv
from kvcompress.harness.tasks.retrieval import split_prompt

TEXT = "The cat sat. A dog ran far away! Birds sing at dawn. Is it late? " * 20


@pytest.fixture
def hay(tmp_path):
    path = tmp_path / "hay.txt"
    path.write_text(TEXT)
    return str(path)


def test_values_have_their_kind_s_shape():
    rng = random.Random(0)
    for n in (5, 6, 7, 8):
        values = [lv.draw_value(f"digits{n}", rng) for _ in range(50)]
        assert all(len(v) == n and v.isdigit() and v[0] != "0" for v in values)
    uuids = [lv.draw_value("uuid", rng) for _ in range(50)]
    assert all(re.fullmatch(r"[0-9][0-9a-f]{7}-[0-9a-f]{4}-[0-9a-f]{4}", u) for u in uuids)
    with pytest.raises(ValueError, match="digits<N>"):
        lv.draw_value("words", rng)


@pytest.mark.parametrize("kind", lv.KINDS)
@pytest.mark.parametrize("chat", [True, False])
def test_positions_map_back_to_the_answer_and_its_needle(char_tokenizer, hay, kind, chat):
    case = lv.make_value_case(char_tokenizer, 200, 40.0, kind, text=hay, chat=chat)
    head = case.head[0]
    assert char_tokenizer.decode(head[case.answer]) == case.value
    assert char_tokenizer.decode(head[case.needle]) == lv.NEEDLE.format(value=case.value)
    assert case.answer == list(range(case.answer[0], case.answer[-1] + 1))  # adjacent, inside the needle
    assert set(case.answer) <= set(case.needle)
    context = char_tokenizer.decode(head)
    head_ids, tail_ids = split_prompt(
        char_tokenizer, context[context.index("The cat") :] if chat else context, lv.QUESTION, chat,
        lv.ANSWER_PREFIX,
    )  # fmt: skip
    assert torch.equal(case.tail, tail_ids) and torch.equal(case.head, head_ids)
    whole = torch.cat([case.head, case.tail], 1)[0]  # question in the prompt: the same positions
    assert char_tokenizer.decode(whole[case.answer]) == case.value
    assert char_tokenizer.decode(whole[case.question]).endswith(lv.ANSWER_PREFIX)


def test_cases_are_seeded_and_cycle_the_kinds(char_tokenizer, hay):
    cases = lv.value_cases(char_tokenizer, 6, 200, text=hay)
    assert [c.kind for c in cases] == [*lv.KINDS, lv.KINDS[0]]
    again = lv.value_cases(char_tokenizer, 6, 200, text=hay)
    assert [(c.value, c.depth) for c in cases] == [(c.value, c.depth) for c in again]
    assert all(5 <= c.depth <= 95 for c in cases)
    with pytest.raises(ValueError, match="must exceed"):
        lv.make_value_case(char_tokenizer, 20, 50.0, "digits5", text=hay)


@pytest.mark.integration
def test_positions_on_the_embedded_tokenizer(real_model):
    _, tok = real_model
    for case in lv.value_cases(tok, 5, 300):
        assert tok.decode(case.head[0, case.answer]).strip() == case.value
        if case.kind != "uuid":  # digits are tokenized one by one
            assert len(case.answer) == len(case.value)


def test_a_case_records_what_each_layer_and_head_read_of_the_answer(llama, char_tokenizer, hay):
    case = lv.make_value_case(char_tokenizer, 200, 30.0, "digits6", text=hay, chat=False)
    layers, heads, n = llama.config.num_hidden_layers, llama.config.num_key_value_heads, len(case.answer)
    for mode in (True, False):
        full = lv.run_value_case(llama, char_tokenizer, make_policy("full"), case, mode, {95})
        assert torch.tensor(full["answer_first"]).shape == (layers, heads)
        assert full["answer_first"] == full["answer_all"] == full["answer_any"] == [[n] * heads] * layers
        assert full["answer_tokens_read"] == [1.0] * n and abs(full["cache_ratio"] - 1) < 0.05
        # a window of the newest tokens: the answer, near the start, is never read after the prompt
        window = make_policy("sliding_window", sink_tokens=0, window=40)
        out = lv.run_value_case(llama, char_tokenizer, window, case, mode, {95})
        assert out["answer_first"] == out["answer_all"] == [[0] * heads] * layers
        assert out["answer_any"] == [[n if mode else 0] * heads] * layers  # the prefill read everything


def test_tiered_reads_are_its_fetched_pages_and_hot_tokens(llama, char_tokenizer, hay):
    case = lv.make_value_case(char_tokenizer, 200, 30.0, "digits7", text=hay, chat=False)
    heads, n = llama.config.num_key_value_heads, len(case.answer)
    storage = {"name": "offload", "block_size": 4, "recent": 8, "lru_pages": 64}
    every = make_policy("tiered", top_k_blocks=64, storage=storage, prefill_chunk=32)
    out = lv.run_value_case(llama, char_tokenizer, every, case, False, {95})
    assert out["answer_first"] == out["answer_any"] == [[n] * heads] * llama.config.num_hidden_layers
    one = make_policy("tiered", top_k_blocks=1, sink_blocks=1, storage=storage, prefill_chunk=32)
    out = lv.run_value_case(llama, char_tokenizer, one, case, False, {95})
    assert max(max(row) for row in out["answer_first"]) == 0  # only the sink page: the answer sits later
