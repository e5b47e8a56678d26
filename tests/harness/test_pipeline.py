"""``kvcompress.pipeline`` and ``kvcompress ask``: one compressed context, several questions, nothing of one
question reaching the next, the model left as it was."""

from __future__ import annotations

import json

import pytest
import torch

import kvcompress
from kvcompress import build_cache
from kvcompress.harness import ask
from kvcompress.harness.pipeline import Answers
from kvcompress.harness.tasks.retrieval import answer, eos_ids, split_prompt

CONTEXT = "The keeper of the north light was Ada Marlow; her number was 7392 and she kept two goats. " * 3
QUESTIONS = ["Who kept the light?", "What was her number?", "How many goats?"]


def _alone(model, tok, policy, question: str, question_in_prompt: bool, **params) -> str:
    """The answer of a fresh cache given only this question (the tasks' own path)."""
    head, tail = split_prompt(tok, CONTEXT, question, chat=True)
    cache = build_cache(policy, model, **params)
    ids = answer(model, cache, head, tail, question_in_prompt, 8, eos_ids(model, tok), tok)
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("policy", ["full", "snapkv", "kvzip"])
@pytest.mark.parametrize("question_in_prompt", [False, True])
def test_each_answer_is_the_one_a_fresh_cache_gives(llama, char_tokenizer, policy, question_in_prompt):
    params = {} if policy == "full" else {"compression_ratio": 0.5}
    pipe = kvcompress.pipeline(llama, char_tokenizer, policy, **params)
    out = pipe(CONTEXT, QUESTIONS, max_new_tokens=8, question_in_prompt=question_in_prompt)
    want = [_alone(llama, char_tokenizer, policy, q, question_in_prompt, **params) for q in QUESTIONS]
    assert out.answers == want and list(out) == want and out[-1] == want[-1] and len(out) == len(QUESTIONS)
    assert any(a for a in out.answers)  # the tiny model answers something (the check is not vacuous)
    assert [s["question"] for s in out.stages if s["stage"] == "answer"] == [0, 1, 2]


def test_answers_iterate_index_and_count_as_their_list():
    stage = {"stage": "answer", "question": 1, "seconds": 0.5, "tokens": 3, "cache_bytes": 8}
    out = Answers(["Ada", "7392", "two"], [stage], "full")
    first, second, third = out
    assert (first, second, third) == ("Ada", "7392", "two") and [a for a in out] == out.answers
    assert (out[0], out[-1], out[1:], out[::2]) == ("Ada", "two", ["7392", "two"], ["Ada", "two"])
    assert len(out) == 3 and list(reversed(out)) == ["two", "7392", "Ada"]
    with pytest.raises(IndexError):
        out[3]
    assert out.answers == ["Ada", "7392", "two"] and out.stages == [stage] and out.policy == "full"
    assert "| answer | 1 | 0.500 | 3 | 8 |  |" in out.table()


def test_the_context_is_compressed_once_and_its_stages_are_measured(llama, char_tokenizer):
    out = kvcompress.pipeline(llama, char_tokenizer, "kvzip", compression_ratio=0.5)(CONTEXT, QUESTIONS, 4)
    prefill, context_pass, *answers = out.stages
    assert (prefill["stage"], context_pass["stage"]) == ("prefill", "context_pass")
    assert len(answers) == 3 and {s["stage"] for s in answers} == {"answer"}
    assert context_pass["cache_bytes"] < 0.6 * prefill["cache_bytes"]  # half the tokens evicted, once
    assert context_pass["tokens_stored"] == pytest.approx(prefill["tokens_stored"] / 2, abs=1)
    assert all(s["seconds"] > 0 for s in out.stages)
    assert "| context_pass |" in out.table()


def test_the_model_is_left_as_it_was(llama, char_tokenizer):
    before = (llama.config._attn_implementation, dict(vars(llama.config)))
    kvcompress.pipeline(llama, char_tokenizer, "h2o", budget=40)(CONTEXT, QUESTIONS[:1], 4)
    assert (llama.config._attn_implementation, dict(vars(llama.config))) == before


def test_bad_input_is_refused_by_name(llama, char_tokenizer):
    with pytest.raises(ValueError, match="no_such_policy"):
        kvcompress.pipeline(llama, char_tokenizer, "no_such_policy")
    with pytest.raises(ValueError, match="compression_ratio"):
        kvcompress.pipeline(llama, char_tokenizer, "snapkv", compression_ratio=1.5)
    pipe = kvcompress.pipeline(llama, char_tokenizer)
    with pytest.raises(ValueError, match="questions"):
        pipe(CONTEXT, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        pipe(CONTEXT, QUESTIONS, max_new_tokens=0)


def test_ask_command_answers_and_writes_its_record(tiny_checkpoint, tmp_path, capsys):
    context = tmp_path / "context.txt"
    context.write_text(CONTEXT, encoding="utf-8")
    out = tmp_path / "answers.json"
    argv = ["--context", str(context), "--question", QUESTIONS[0], "--question", QUESTIONS[1],
            "--policy", "snapkv", "--set", "compression_ratio=0.5", "--model", str(tiny_checkpoint),
            "--device", "cpu", "--max-new-tokens", "4", "--json", str(out)]  # fmt: skip
    record = ask.main(argv)
    printed = capsys.readouterr().out
    assert f"Q: {QUESTIONS[1]}" in printed and "| prefill |" in printed
    saved = json.loads(out.read_text())
    assert saved == record and saved["params"] == {"compression_ratio": 0.5}
    assert len(saved["answers"]) == 2 and saved["policy"] == "snapkv"
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        ask.main(["--context", str(context), "--question", "q", "--set", "oops"])
    with pytest.raises(SystemExit, match="no such file"):
        ask.main(["--context", str(tmp_path / "missing.txt"), "--question", "q"])


@torch.inference_mode()
def test_restoring_the_snapshot_drops_what_a_question_added(llama, char_tokenizer):
    """The second of two identical questions gets the first's answer, token for token (no leak)."""
    out = kvcompress.pipeline(llama, char_tokenizer, "h2o", budget=40)(CONTEXT, [QUESTIONS[0]] * 2, 8)
    assert out.answers[0] == out.answers[1]
    first, second = (s for s in out.stages if s["stage"] == "answer")
    assert first["cache_bytes"] == second["cache_bytes"]
