"""One context, several questions: compress the context once, answer each question from its snapshot.

What kvpress's ``kv-press-text-generation`` pipeline offers, measured as the rest of kvcompress is::

    pipe = kvcompress.pipeline(model, tokenizer, "snapkv", compression_ratio=0.5)
    out = pipe(context, questions=["Who wrote it?", "When?"], max_new_tokens=32)
    out.answers        # ["...", "..."]; out[0], out[-1:], len(out) and ``for answer in out`` read them too
    out.stages         # seconds and bytes of the prefill, the context pass and each answer

The context is prefilled once (with a query-agnostic selector's context pass: KVzip reconstructs it), its
compressed state is snapshotted, and every question starts from an exact copy of that snapshot
(``KVCache.restore``), so nothing of one question or answer reaches the next. The question is fed token
by token (decode steps, which a prefill-time selector does not compress) and the answer is greedy.

``question_in_prompt=True`` is the other setting: the question joins the context in the compressed prompt
(the selector may then look at it), so the context is compressed again for each question.

The model's attention implementation and config are left as they were after each call
(``kvcompress.attached``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvcompress.core.attention import attached
from kvcompress.core.cache import build_cache, make_policy
from kvcompress.harness.tasks.retrieval import eos_ids, feed, greedy, split_prompt
from kvcompress.runtime.context_pass import compress_context, forward_prompt, needs_context_pass


@dataclass
class Answers:
    """``answers`` (one per question, in order) and ``stages``: a list of dicts, one per stage, each with
    ``stage`` (``prefill``, ``context_pass``, ``answer``), ``seconds``, ``tokens`` (fed, or generated for an
    answer), ``cache_bytes`` (every byte the cache holds after the stage) and ``tokens_stored`` (mean per
    layer); an answer's stage also names its ``question`` index. Iterating, indexing (slices too) and
    ``len`` read ``answers``."""

    answers: list[str]
    stages: list[dict] = field(default_factory=list)
    policy: str = ""

    def __iter__(self) -> Iterator[str]:
        return iter(self.answers)

    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self.answers[index]

    def __len__(self) -> int:
        return len(self.answers)

    def table(self) -> str:
        """The stages as a markdown table."""
        cols = ["stage", "question", "seconds", "tokens", "cache_bytes", "tokens_stored"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for s in self.stages:
            cells = [s.get(c, "") for c in cols]
            text = (f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells)
            lines.append("| " + " | ".join(text) + " |")
        return "\n".join(lines)


class ContextPipeline:
    """The callable ``kvcompress.pipeline`` returns (see the module docstring)."""

    def __init__(self, model, tokenizer, policy="full", chat_template: bool | None = None, **params):
        self.model, self.tokenizer = model, tokenizer
        self.policy = make_policy(policy, **params)  # refuses a bad name or field now, not at the first call
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.chat = has_template if chat_template is None else chat_template
        self.stop = eos_ids(model, tokenizer)

    def __call__(
        self,
        context: str,
        questions: list[str] | str,
        max_new_tokens: int = 32,
        question_in_prompt: bool = False,
        answer_prefix: str = "",
    ) -> Answers:
        questions = [questions] if isinstance(questions, str) else list(questions)
        if not questions:
            raise ValueError("questions: give at least one question")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        parts = [split_prompt(self.tokenizer, context, q, self.chat, answer_prefix) for q in questions]
        with attached(self.model), torch.inference_mode():
            if question_in_prompt:
                return self._each_compressed(parts, max_new_tokens)
            return self._shared_context(parts, max_new_tokens)

    def _shared_context(self, parts, max_new: int) -> Answers:
        head = parts[0][0]
        cache = build_cache(self.policy, self.model)
        stages = self._compress(cache, head)
        stages[0].pop("logits")  # the question comes next: the context's own next-token logits are not used
        snapshot = cache.snapshot()
        answers = []
        for i, (_, tail) in enumerate(parts):
            cache.restore(snapshot)
            start = time.perf_counter()
            ids = greedy(self.model, cache, feed(self.model, cache, tail), max_new, self.stop)
            answers.append(self.tokenizer.decode(ids, skip_special_tokens=True))
            stages.append(_stage("answer", start, len(ids), cache, question=i))
        return Answers(answers, stages, self.policy.name)

    def _each_compressed(self, parts, max_new: int) -> Answers:
        answers, stages = [], []
        for i, (head, tail) in enumerate(parts):
            cache = build_cache(self.policy, self.model)
            prompt = torch.cat([head, tail], 1)
            steps = self._compress(cache, prompt)
            logits = steps[0].pop("logits")
            start = time.perf_counter()
            ids = greedy(self.model, cache, logits, max_new, self.stop)
            answers.append(self.tokenizer.decode(ids, skip_special_tokens=True))
            stages += [{**s, "question": i} for s in steps]
            stages.append(_stage("answer", start, len(ids), cache, question=i))
        return Answers(answers, stages, self.policy.name)

    def _compress(self, cache, ids) -> list[dict]:
        """Prefill ``ids`` (1, n), then the context pass when the policy has one: a stage each."""
        start = time.perf_counter()
        out = forward_prompt(self.model, cache, ids)
        stages = [{**_stage("prefill", start, ids.shape[1], cache), "logits": out.logits[:, -1:]}]
        if needs_context_pass(cache):
            start = time.perf_counter()
            info = compress_context(self.model, cache, ids, self.tokenizer)
            stages.append(_stage("context_pass", start, ids.shape[1], cache, chunks=info["context_chunks"]))
        return stages


def _stage(name: str, start: float, tokens: int, cache, **extra) -> dict:
    stats = cache.stats()
    return {
        "stage": name,
        "seconds": time.perf_counter() - start,
        "tokens": tokens,
        "cache_bytes": cache.memory_bytes(),
        "tokens_stored": sum(s["tokens_stored"] for s in stats) / len(stats),
        **extra,
    }


def pipeline(model, tokenizer, policy="full", chat_template: bool | None = None, **params) -> ContextPipeline:
    """A context-and-questions pipeline over ``model`` with a ``policy`` cache (a name from
    ``conf/policy/``, a config dict or a ``Policy``; ``params`` override its fields, as in ``build_cache``).
    ``chat_template``: wrap context and question in the tokenizer's chat template (default: when it has
    one)."""
    return ContextPipeline(model, tokenizer, policy, chat_template, **params)
