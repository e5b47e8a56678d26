"""Several questions on one compressed context, SCBench-style (Li et al., "SCBench: A KV Cache-Centric
Analysis of Long-Context Methods", arXiv 2412.10319): the context is prefilled and compressed once, then

- ``independent``: every question starts from the restored snapshot of the compressed context (shared
  context, as prefix caching serves it: nothing of an earlier question or answer remains);
- ``multiturn``: the questions are successive chat turns; each keeps the history (answers included).

Questions are fed token by token (decode steps), as in the retrieval tasks' question-after mode.
"""

from __future__ import annotations

import torch

from kvcompress.harness.tasks.retrieval import feed, greedy
from kvcompress.runtime.context_pass import prefill

MODES = ("independent", "multiturn")
_MARKS = ("\x00a\x00", "\x00b\x00", "\x00c\x00")


def next_turn_text(tokenizer, question: str, answer_prefix: str, chat: bool) -> str:
    """What follows the model's answer when the next question comes as a new turn (end of the answer, the
    user's question, the start of the next answer), from the chat template."""
    if not chat:
        return "\n\n" + question + "\n\n" + answer_prefix
    a, b, c = _MARKS
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": a}, {"role": "assistant", "content": b}, {"role": "user", "content": c}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return text.split(b, 1)[1].replace(c, question) + answer_prefix


def token_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


@torch.inference_mode()
def ask_all(model, tokenizer, cache, head, turns: list[dict], mode: str, max_new: int, stop) -> list[str]:
    """Prefill and compress ``head`` (1, n) once, then answer every turn; returns the responses.

    Args:
        turns: per question ``first`` (ids (1, m) that ask it right after the context) and ``next`` (ids
            that ask it as a later chat turn).
    """
    if mode not in MODES:
        raise ValueError(f"task.mode={mode!r} is not supported; allowed: {list(MODES)}")
    prefill(model, cache, head, tokenizer)
    snapshot = cache.snapshot() if mode == "independent" else None
    responses = []
    for i, turn in enumerate(turns):
        if snapshot is not None:
            cache.restore(snapshot)
        ids = turn["first"] if snapshot is not None or i == 0 else turn["next"]
        out = greedy(model, cache, feed(model, cache, ids), max_new, stop)
        responses.append(tokenizer.decode(out, skip_special_tokens=True))
    return responses
