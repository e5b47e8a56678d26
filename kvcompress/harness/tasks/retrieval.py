"""Shared machinery of retrieval tasks (needle in a haystack, passkey): prompt, compress, answer, score.

A case is a context with a fact hidden at some depth, a question and the expected answer. Two modes:
``question_in_prompt=True`` prefills context and question together (the question is compressed with
the prompt, as in SnapKV's paper); ``False`` prefills and compresses the context first and then feeds
the question token by token, as decode steps (as kvpress evaluates). The answer is greedy-decoded
until the model's own end-of-turn ids (``generation_config.eos_token_id``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvcompress.core.cache import build_cache
from kvcompress.metrics.acted import storage_use
from kvcompress.metrics.compression import (
    attention_backends,
    effective_ratios,
    full_cache_bytes,
    is_compressed,
    read_ratio,
    tokens_evicted,
)
from kvcompress.metrics.memory import tier_summary
from kvcompress.runtime.context_pass import prefill


@dataclass
class Case:
    """One grid cell: the context (with the fact inside), its question and expected answer."""

    length: int
    depth: float
    context: str
    question: str
    answer: str
    fact_token: int  # token index in the context where the fact starts


def split_prompt(tokenizer, context: str, question: str, chat: bool, answer_prefix: str = ""):
    """Token ids (1, n) of the context part and of the question part of one prompt (``prompt_texts``)."""
    head, tail = prompt_texts(tokenizer, context, question, chat, answer_prefix)
    encode = lambda s: tokenizer(s, add_special_tokens=False, return_tensors="pt").input_ids  # noqa: E731
    return encode(head), encode(tail)


def prompt_texts(tokenizer, context: str, question: str, chat: bool, answer_prefix: str = ""):
    """Text of the context part and of the question part of one prompt, each encoded on its own.

    With ``chat`` the tokenizer's chat template wraps ``context + question`` in one user turn and the
    split falls right after the context, so both modes see the same tokens.
    """
    sep = "\n\n"
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "task.chat_template=true but the tokenizer has no chat template; set it to false"
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + sep + question}],
            tokenize=False,
            add_generation_prompt=True,
        )
        cut = text.index(context) + len(context)
        head, tail = text[:cut], text[cut:] + answer_prefix
    else:
        head, tail = context, sep + question + sep + answer_prefix
    return head, tail


def eos_ids(model, tokenizer) -> set[int]:
    """End-of-turn ids from the model's generation config (the tokenizer's eos may differ)."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = tokenizer.eos_token_id if ids is None else ids
    return {ids} if isinstance(ids, int) else set(ids)


@torch.inference_mode()
def answer(model, cache, head, tail, question_in_prompt: bool, max_new_tokens: int, stop: set[int],
           tokenizer=None):  # fmt: skip
    """Prefill (plus a query-agnostic policy's context pass), feed the question, greedy-decode; returns the
    generated token ids."""
    if question_in_prompt:
        logits = prefill(model, cache, torch.cat([head, tail], 1), tokenizer).logits
    else:
        prefill(model, cache, head, tokenizer)
        logits = feed(model, cache, tail)  # decode steps: the context is already compressed
    return greedy(model, cache, logits, max_new_tokens, stop)


def feed(model, cache, ids) -> torch.Tensor:
    """Feed ``ids`` (1, n) one token per forward (decode steps); returns the last step's logits."""
    logits = None
    for i in range(ids.shape[1]):
        logits = model(ids[:, i : i + 1].to(model.device), cache=cache, use_cache=True).logits
    return logits


def greedy(model, cache, logits, max_new_tokens: int, stop: set[int]) -> list[int]:
    """Greedy tokens from ``logits`` (1, q, V) until a ``stop`` id (not fed) or ``max_new_tokens``."""
    out = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        if nxt in stop:
            break
        out.append(nxt)
        logits = model(torch.tensor([[nxt]], device=model.device), cache=cache, use_cache=True).logits
    return out


def normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", re.sub(r"\s+", " ", text.lower())).strip()


def is_correct(response: str, expected: str) -> bool:
    """Exact match of the whole answer, as words, anywhere in the response, after normalisation (case,
    punctuation, spaces): "7,392." matches 7392, "73920" does not."""
    return f" {normalize(expected)} " in f" {normalize(response)} "


def run_case(model, tokenizer, policy, case: Case, cfg) -> dict:
    """One case through a fresh policy cache; a record for ``results.json``."""
    head, tail = case_prompt(tokenizer, case, cfg)
    cache = build_cache(policy, model)
    stop = eos_ids(model, tokenizer)
    ids = answer(model, cache, head, tail, cfg.question_in_prompt, cfg.max_new_tokens, stop, tokenizer)
    prompt = head.shape[1] + (tail.shape[1] if cfg.question_in_prompt else 0)  # then one token a forward
    fields = cache_fields(model, policy, cache, prefill=prompt)
    return {**case_record(tokenizer, case, cfg, head, tail, ids), **fields}


TIER_BYTES = ("device_bytes", "host_bytes", "disk_bytes", "bytes_fetched_per_step")


def cache_fields(model, policy, cache, rows: int = 1, prefill: int | None = None) -> dict:
    """A case's cache numbers: slots stored per layer, bytes (per row of a batch of ``rows``: the batch
    cache's bytes shared out), its ratio to ``full``'s on the same rows fed the same way (``prefill`` tokens
    in one forward, then one per forward; None: all in one), the read ratio, tokens evicted (slots: each row
    lost as many, padding slots included), ``compressed`` (``metrics.compression``), whether an exact-window
    storage encoded anything (``metrics.acted``), and a tiered cache's bytes per tier and traffic."""
    stats, evicted, read = cache.stats(), tokens_evicted(cache), read_ratio(cache)
    tiers = tier_summary(stats)  # tiered: bytes per tier, fetches per step, LRU hit rate
    tiers |= {k: tiers[k] / rows for k in TIER_BYTES if k in tiers}
    full = full_cache_bytes(model, cache.get_seq_length(), rows, prefill)  # remembered per length and prefill
    return {
        "tokens_stored_mean": sum(s["tokens_stored"] for s in stats) / len(stats),
        "cache_bytes": cache.memory_bytes() / rows if rows > 1 else cache.memory_bytes(),
        "cache_ratio": cache.memory_bytes() / full,
        "read_ratio": read,
        "tokens_evicted": evicted,
        "compressed": is_compressed(evicted, cache.memory_bytes(), full, read),
        "attention_backends": attention_backends(cache),
        **effective_ratios(stats),
        **storage_use(stats),
        **tiers,
    }


def case_prompt(tokenizer, case: Case, cfg):
    """Token ids (1, n) of the case's context part and question part (``split_prompt``)."""
    return split_prompt(
        tokenizer, case.context, case.question, cfg.chat_template, cfg.get("answer_prefix", "")
    )


def case_record(tokenizer, case: Case, cfg, head, tail, ids: list[int]) -> dict:
    """The fields of a case's record that do not describe its cache: prompt sizes, response, score."""
    response = tokenizer.decode(ids, skip_special_tokens=True)
    return {
        "length": case.length,
        "depth": case.depth,
        "question_in_prompt": bool(cfg.question_in_prompt),
        "prompt_tokens": head.shape[1] + tail.shape[1],
        "context_tokens": head.shape[1],
        "fact_token": case.fact_token,
        "expected": case.answer,
        "response": response,
        "correct": is_correct(response, case.answer),
    }
