"""The offline RULER suite (kvc_ruler_*) and the question-after mode of lm-eval generation, on the embedded
default: lm-eval's own documents, `full` answering exactly as lm-eval's `hf`, and a context compressed
without its question."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvcompress import build_cache, make_policy
from kvcompress.resources.models import default_model_dir

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("wonderwords")
import kvcompress.eval.adapter  # noqa: E402,F401  (registers model="kvcompress")
from kvcompress.eval import task_manager  # noqa: E402
from kvcompress.eval.question import compress_then_feed, parse_mode, question_index  # noqa: E402

pytestmark = [pytest.mark.integration]
LENGTH = 512  # the shortest length lm-eval's noise haystack reaches quickly: keeps the generations cheap
GEN = {"until": ["\n"], "max_gen_toks": 16}


def _meta() -> dict:
    return {"tokenizer": str(default_model_dir()), "max_seq_lengths": [LENGTH]}


def _run(model: str, task: str, limit: int, **model_args) -> dict:
    args = {"pretrained": str(default_model_dir()), "device": "cpu", "dtype": "float32", **model_args}
    manager = None if task.startswith(("niah_", "ruler_")) else task_manager([task], metadata=_meta())
    return lm_eval.simple_evaluate(
        model=model, model_args=args, tasks=[task], task_manager=manager, metadata=_meta(), limit=limit,
        gen_kwargs=GEN, log_samples=True, bootstrap_iters=0,
    )  # fmt: skip


def _prompts(out: dict, task: str) -> list[str]:
    return [s["arguments"][0][0] for s in out["samples"][task]]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir())


def test_builders_reproduce_lm_evals_documents():
    from lm_eval.tasks.ruler import niah_utils, vt_utils

    from kvcompress.eval.lm_tasks import kvc_ruler as ours

    pairs = ((ours.niah_single, niah_utils.niah_single_1), (ours.variable_tracking, vt_utils.get_vt_dataset))
    for (mine, theirs), length in zip(pairs, (LENGTH, 1024), strict=True):
        meta = {**_meta(), "max_seq_lengths": [length]}  # variable tracking needs 1024 (refused below)
        a = mine(**meta)["test"]
        random.seed(0)  # what lm-eval's simple_evaluate does before it builds its first task
        np.random.seed(1234)
        b = theirs(**dict(meta))["test"]
        assert a[:3]["input"] == mine(**meta)["test"][:3]["input"]  # seeded: the same documents every time
        assert len(a) == len(b) == 500
        assert a[:5]["input"] == b[:5]["input"] and a[:5]["outputs"] == b[:5]["outputs"]
    with pytest.raises(ValueError, match="max_seq_lengths=.512.: every length must be >= 1024"):
        ours.variable_tracking(**_meta())
    multi = ours.niah_multivalue(**_meta())["test"][0]
    assert len(multi["outputs"]) == 4 and "The grass is green" in multi["input"]  # 4 values, noise haystack


@pytest.mark.slow
def test_full_answers_exactly_as_lm_evals_hf_on_the_same_prompts():
    stock = _run("hf", "niah_single_1", 3)
    ours = _run("kvcompress", "kvc_ruler_niah_single", 3, policy="full")
    assert _prompts(ours, "kvc_ruler_niah_single") == _prompts(stock, "niah_single_1")
    pairs = zip(stock["samples"]["niah_single_1"], ours["samples"]["kvc_ruler_niah_single"], strict=True)
    for theirs, mine in pairs:
        assert mine["resps"] == theirs["resps"]
        assert mine["score"] == theirs[str(LENGTH)]  # lm-eval's string_match_all, keyed by length there
    score = ours["results"]["kvc_ruler_niah_single"]["score,none"]
    assert score == stock["results"]["niah_single_1"][f"{LENGTH},none"]


def test_question_index_finds_the_last_question_and_refuses_none(tokenizer):
    text = "Some text.\nWhat is it? No.\nThe grass is green.\nWhat is the special magic number for x?"
    ids = tokenizer(text)["input_ids"]
    q = question_index(tokenizer, ids)
    assert tokenizer.decode(ids[q:]).startswith("What is the special magic number")
    assert tokenizer.decode(ids[:q]).endswith("The grass is green.\n")
    own = tokenizer("Some text. Q: is it? The grass is green. Q: which number?")["input_ids"]
    mine = question_index(tokenizer, own, r"Q: which")  # a pattern that opens with no newline
    assert tokenizer.decode(own[mine:]).lstrip().startswith("Q: which")
    assert "which" not in tokenizer.decode(own[:mine])
    with pytest.raises(ValueError, match="question_start"):
        question_index(tokenizer, tokenizer("no question here at all")["input_ids"])
    assert parse_mode("False") is False and parse_mode(True) is True
    with pytest.raises(ValueError, match="question_in_prompt='maybe'"):
        parse_mode("maybe")


def test_question_after_compresses_the_context_alone(real_model, tokenizer):
    from kvcompress.eval.lm_tasks import kvc_ruler

    real_model = real_model[0]  # (model, tokenizer)
    doc = kvc_ruler.niah_single(**_meta())["test"][0]
    ids = torch.tensor([tokenizer(doc["input"] + " " + doc["gen_prefix"])["input_ids"]])
    q = question_index(tokenizer, ids[0].tolist())
    snapkv = make_policy("snapkv", compression_ratio=0.75)

    def kept(n: int) -> int:  # tokens a fresh snapkv cache stores after a prefill of the first n
        cache = build_cache(snapkv, real_model)
        with torch.no_grad():
            real_model(ids[:, :n], cache=cache, use_cache=True)
        return cache.layers[0].stored_length()

    after = build_cache(snapkv, real_model)
    assert compress_then_feed(real_model, after, ids, tokenizer) == q
    # the context alone was compressed (to about a quarter); the question's tokens follow it, all kept
    assert kept(q) <= q * 0.25 + 1
    assert after.layers[0].stored_length() == kept(q) + (ids.shape[1] - 1 - q)
    assert after.get_seq_length() == ids.shape[1] - 1  # generate() feeds the last token
    with pytest.raises(ValueError, match="batch_size=1"):
        compress_then_feed(
            real_model, build_cache(make_policy("full"), real_model), ids.repeat(2, 1), tokenizer
        )


@pytest.mark.slow
def test_full_gives_the_same_answers_in_both_question_modes(monkeypatch):
    from kvcompress.eval import adapter

    splits = []  # the requests the adapter compressed without their question

    def counted(*args, **kwargs):
        splits.append(compress_then_feed(*args, **kwargs))
        return splits[-1]

    monkeypatch.setattr(adapter, "compress_then_feed", counted)
    prompt = _run("kvcompress", "kvc_ruler_niah_single", 2, policy="full")
    assert splits == []
    after = _run("kvcompress", "kvc_ruler_niah_single", 2, policy="full", question_in_prompt="false")
    assert len(splits) == 2  # every request of the question-after run took that path
    assert [s["resps"] for s in after["samples"]["kvc_ruler_niah_single"]] == [
        s["resps"] for s in prompt["samples"]["kvc_ruler_niah_single"]
    ]
    assert after["config"]["kvcompress"]["question_in_prompt"] is False
