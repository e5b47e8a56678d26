"""Needles whose value spans many tokens: 5-8 digit numbers and UUID-like hex strings, positions known.

SmolLM2's tokenizer splits digits one by one (and hex strings nearly so), so a 7-digit answer is 7 tokens
that must all survive compression. Each case puts one such value in the embedded essays (``niah``'s
haystack and insertion) and records the exact token positions of the value and of its needle sentence in
the context part of the prompt: the same positions in both question modes (question in the prompt: the
whole prompt ``head + tail`` is compressed; question after: ``head`` is compressed alone, ``tail`` is fed).
``kvcompress.metrics.retention`` turns what a cache holds at those positions into retention numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvcompress.core.cache import build_cache
from kvcompress.harness.tasks.niah import _haystack_ids, insert_needle
from kvcompress.harness.tasks.retrieval import feed, is_correct, prompt_texts
from kvcompress.metrics.compression import full_cache_bytes
from kvcompress.metrics.retention import ReadSets, span_found, span_hits
from kvcompress.runtime.context_pass import prefill

KINDS = ("digits5", "digits6", "digits7", "digits8", "uuid")
HEX = "0123456789abcdef"
UUID_GROUPS = (8, 4, 4)
# One needle for every kind: SmolLM2-135M uncompressed finds UUID-like values asked as a "magic number"
# (3 of 5 in a probe) far more often than as an "access code" (0 of 10) or a "magic uuid" (1 of 5).
NEEDLE = "The special magic number is {value}."
QUESTION = "What is the special magic number?"
ANSWER_PREFIX = "The special magic number is"  # the reply opens with the value
EXTRA_TOKENS = 4  # generated beyond the answer's own token count


@dataclass
class ValueCase:
    """One long-value needle in a context; positions index ``head`` (and the whole prompt ``head + tail``)."""

    kind: str
    value: str
    depth: float
    head: torch.Tensor  # (1, n) context part: compressed alone when the question comes after
    tail: torch.Tensor  # (1, m) question part (chat turn switch included)
    answer: list[int]  # positions of the value's own tokens
    needle: list[int]  # positions of the needle sentence's tokens (the value's included)

    @property
    def question(self) -> list[int]:
        """Positions of the question part in the whole prompt."""
        n = self.head.shape[1]
        return list(range(n, n + self.tail.shape[1]))


def draw_value(kind: str, rng: random.Random) -> str:
    """A value of ``kind``: ``digitsN`` an N-digit number (no leading zero), ``uuid`` 8-4-4 hex groups
    opening with a decimal digit (a leading letter merges with the space before it into one token, and the
    uncompressed model then missed 5 of 5 in a probe: no reference left to compare against)."""
    if kind == "uuid":
        text = "-".join("".join(rng.choice(HEX) for _ in range(n)) for n in UUID_GROUPS)
        return rng.choice(HEX[:10]) + text[1:]
    if kind.startswith("digits") and kind[6:].isdigit() and int(kind[6:]) >= 1:
        n = int(kind[6:])
        return str(rng.randrange(10 ** (n - 1), 10**n))
    raise ValueError(f"long value kind={kind!r}; allowed: digits<N> (N >= 1) or uuid, e.g. {list(KINDS)}")


def token_span(tokenizer, text: str, ids: list[int], start: int, end: int) -> list[int]:
    """Positions of the tokens of ``text`` (encoded as ``ids``) that overlap characters ``[start, end)``.

    Refuses a text whose offsets do not describe ``ids`` (the positions would index other tokens)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != ids:
        raise ValueError(
            "long values: the context does not re-tokenize to its own ids; positions would be off"
        )
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]


def make_value_case(
    tokenizer, length: int, depth: float, kind: str, seed: str = "0", text: str = "pg_essays", chat=True
) -> ValueCase:
    """A ``kind`` value (drawn from ``seed``) in a needle at ``depth`` percent of ``length`` context
    tokens."""
    value = draw_value(kind, random.Random(f"{seed}-{kind}"))
    needle, question, prefix = NEEDLE.format(value=value), QUESTION, ANSWER_PREFIX
    n_needle = len(tokenizer(" " + needle, add_special_tokens=False).input_ids)
    if length <= n_needle:
        raise ValueError(f"long values: length={length} must exceed the needle's {n_needle} tokens")
    context, _ = insert_needle(tokenizer, _haystack_ids(tokenizer, text, length - n_needle), needle, depth)
    head_text, tail_text = prompt_texts(tokenizer, context, question, chat, prefix)
    encode = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    head, tail = encode(head_text), encode(tail_text)
    if head_text.count(needle) != 1:
        raise ValueError(f"long values: the needle {needle!r} is not found exactly once in the context")
    at = head_text.index(needle)
    first = at + needle.index(value)
    answer = token_span(tokenizer, head_text, head, first, first + len(value))
    sentence = token_span(tokenizer, head_text, head, at, at + len(needle))
    return ValueCase(kind, value, depth, torch.tensor([head]), torch.tensor([tail]), answer, sentence)


def value_cases(tokenizer, n: int, length: int, kinds=KINDS, seed: int = 0, **kw) -> list[ValueCase]:
    """``n`` cases, the kinds in turn, each with its own value and a depth drawn in [5, 95] percent."""
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}-depth-{i}")
        kind = kinds[i % len(kinds)]
        out.append(
            make_value_case(tokenizer, length, round(rng.uniform(5, 95), 1), kind, f"{seed}-{i}", **kw)
        )
    return out


@torch.inference_mode()
def run_value_case(
    model, tokenizer, policy, case: ValueCase, question_in_prompt: bool, stop: set[int]
) -> dict:
    """Answer ``case`` through a fresh ``policy`` cache (greedy, until a ``stop`` id), watching what every
    layer and KV head reads; a record of the response, its exact match and the span hits (L, H_kv) of the
    answer, the needle sentence and the question (``metrics.retention``).

    ``answer_first`` etc. are read at the answer's first decode step (the forward that feeds its first
    token: the compressed cache as the rest of the answer sees it; in the question-in-prompt mode the first
    token itself came from the prefill, which read the whole prompt); ``answer_all`` at every decode step of
    the answer (what was read throughout), ``answer_any`` at any step of it, the prefill's or last question
    token's included (the pages a page-reading selector's fetches reached)."""
    cache = build_cache(policy, model)
    reads = ReadSets(cache)
    if question_in_prompt:
        logits = prefill(
            model, cache, torch.cat([case.head, case.tail], 1), tokenizer, logits_to_keep=1
        ).logits
    else:
        prefill(model, cache, case.head, tokenizer, logits_to_keep=1)
        logits = feed(model, cache, case.tail)
    steps, out, n = [reads.snapshot()], [], len(case.answer)
    while len(out) < n + EXTRA_TOKENS:
        nxt = int(logits[0, -1].argmax())
        if nxt in stop:
            break
        out.append(nxt)
        logits = model(torch.tensor([[nxt]], device=model.device), cache=cache, use_cache=True).logits
        if len(steps) < n:
            steps.append(reads.snapshot())
    heads, response = model.config.num_key_value_heads, tokenizer.decode(out, skip_special_tokens=True)
    answer = [span_hits(held, case.answer, heads) for held in steps]
    decode = answer[1:] or answer  # a one-token response: its prefill / last question step
    first = steps[1] if len(steps) > 1 else steps[0]
    return {
        "kind": case.kind, "value": case.value, "depth": case.depth, "answer_tokens": n,
        "context_tokens": case.head.shape[1], "prompt_tokens": case.head.shape[1] + case.tail.shape[1],
        "response": response, "correct": is_correct(response, case.value),
        "answer_first": decode[0].tolist(),
        "answer_tokens_read": span_found(first, case.answer, heads).double().mean((0, 1)).tolist(),
        "answer_all": torch.stack(decode).amin(0).tolist(),
        "answer_any": _reached(steps, case.answer, heads).tolist(),
        "needle_first": span_hits(first, case.needle, heads).tolist(), "needle_tokens": len(case.needle),
        "question_first": span_hits(first, case.question, heads).tolist(),
        "question_tokens": len(case.question),
        "cache_ratio": cache.memory_bytes() / (full_cache_bytes(model, 16) / 16 * cache.get_seq_length()),
    }  # fmt: skip


def _reached(steps: list[list[torch.Tensor]], span: list[int], heads: int) -> torch.Tensor:
    """(L, H_kv) count of ``span``'s positions read by at least one of ``steps`` (each: per layer, the
    positions read)."""
    union = [torch.cat([held[i].expand(-1, heads, -1) for held in steps], -1) for i in range(len(steps[0]))]
    return span_hits(union, span, heads)
