"""The question-after mode of lm-eval generation: the context is compressed alone, the question follows.

With ``question_in_prompt=False`` a generation request's prompt is split where its question starts (the
last match of ``question_start``, by default a line opening with ``Question:`` or ``What``: RULER's and
the offline tasks' templates). The context part is prefilled and compressed (a query-agnostic selector's
context pass included) without seeing the question; the question's tokens then stream through the
compressed cache one per forward (decode steps, as kvpress evaluates the reuse setting) and ``generate()``
goes on from there. The prompt's tokens are lm-eval's own: only where the cache is built changes.
"""

from __future__ import annotations

import re

import torch

from kvcompress.runtime.padding import Padded

QUESTION_START = r"\n(?:Question:|What )"


def parse_mode(question_in_prompt) -> bool:
    """``question_in_prompt`` as a bool (model args arrive as strings); refuses anything else by name."""
    if isinstance(question_in_prompt, bool):
        return question_in_prompt
    text = str(question_in_prompt).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"question_in_prompt={question_in_prompt!r}: allowed values are true or false")


def question_index(tokenizer, ids: list[int], pattern: str = QUESTION_START) -> int:
    """Index of the first token of the question in ``ids``: the token whose text holds the start of the
    last match of ``pattern`` (whitespace the match opens with, such as the default's newline, stays with the
    context). Refuses a prompt without one."""
    text = tokenizer.decode(ids)
    matches = list(re.finditer(pattern, text))
    if not matches:
        raise ValueError(
            f"question_in_prompt=false: no question found in a prompt (question_start={pattern!r} does not "
            f"match its text ending {text[-120:]!r}); set question_start to where the task's question begins"
        )
    found = matches[-1].group()
    cut = matches[-1].start() + len(found) - len(found.lstrip())  # its own first character, past any newline
    lo, hi = 0, len(ids)  # the largest q whose decoded prefix ends at or before the cut
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(ids[:mid])) <= cut:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0 or lo >= len(ids):
        raise ValueError(f"question_in_prompt=false: the question starts at token {lo} of {len(ids)}")
    return lo


def compress_then_feed(model, cache, context: torch.Tensor, tokenizer, pattern: str = QUESTION_START) -> int:
    """Prefill and compress ``context`` (1, T) up to its question, feed the question but its last token one
    token per forward; ``generate()`` then feeds the last token. Returns the context's token count."""
    if context.shape[0] != 1:
        raise ValueError(
            "question_in_prompt=false runs one request at a time (each has its own split): set "
            f"batch_size=1, got a batch of {context.shape[0]}"
        )
    q = question_index(tokenizer, context[0].tolist(), pattern)
    with torch.no_grad():
        rows = Padded(model, cache, None)
        rows.prompt(context[:, :q], tokenizer)
        if context.shape[1] - 1 > q:
            rows.feed(context[:, q:-1])
    return q
