"""Retrieval cases several at a time (``task.batch_size``): prompts left-padded into one batch, each row
compressed as if alone (``kvcompress.runtime.padding``), the same records as one case at a time.

Rows of a batch feed their question parts in lockstep after the context, so only cases whose question
parts have the same token count share a batch (in order of the grid otherwise). Per case, ``response`` and
``correct`` are what a batch of one gives; the cache fields describe the batch cache (``batch_rows``
rows): ``cache_bytes`` is its bytes divided by its rows, ``tokens_evicted`` and ``tokens_stored_mean``
its slots (every row's, padding slots included).
"""

from __future__ import annotations

import torch

from kvcompress.core.cache import build_cache
from kvcompress.runtime.padding import Padded, check_padding, left_pad


def batch_size(cfg) -> int:
    """``task.batch_size`` (default 1), validated."""
    size = cfg.get("batch_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"task.batch_size={size!r} must be an integer >= 1")
    return size


def batches(keys: list, size: int) -> list[list[int]]:
    """Indices of items grouped by equal ``keys`` (first appearance order), ``size`` at most per batch."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return [idx[s : s + size] for idx in groups.values() for s in range(0, len(idx), size)]


def padded_stream(model, policy, heads: list[torch.Tensor]):
    """A ``Padded`` stream over a fresh policy cache for ``heads`` (each (1, n)), refused when padding
    is needed and a layer cannot compress padded rows as alone; returns (stream, left-padded ids)."""
    cache = build_cache(policy, model)
    ids, mask = left_pad(heads)
    if mask is not None:
        check_padding(cache, policy.name, "task.batch_size")
    return Padded(model, cache, mask), ids


@torch.inference_mode()
def answer_batch(model, policy, heads, tails, question_in_prompt: bool, max_new: int, stop, tokenizer=None):
    """``retrieval.answer`` for several prompts: ``heads`` (1, n_b) and ``tails`` (1, m), m equal in all
    rows. Returns the stream (its cache) and the generated ids of each row."""
    if question_in_prompt:
        stream, ids = padded_stream(
            model, policy, [torch.cat([h, t], 1) for h, t in zip(heads, tails, strict=True)]
        )
        logits = stream.prompt(ids, tokenizer)
    else:
        stream, ids = padded_stream(model, policy, heads)
        stream.prompt(ids, tokenizer)
        logits = stream.feed(torch.cat(tails, 0))  # decode steps: the contexts are already compressed
    return stream, stream.greedy(logits, max_new, stop)


def cache_shares(model, policy, cache, rows: int, prefill: int | None = None) -> dict:
    """The batch cache's numbers per row (``retrieval.cache_fields``: bytes shared out, slots as they are,
    ``full``'s reference fed ``prefill`` tokens then one a forward) and ``batch_rows``."""
    from kvcompress.harness.tasks.retrieval import cache_fields

    return {**cache_fields(model, policy, cache, rows, prefill), "batch_rows": rows}


def run_cases(model, tokenizer, policy, cases: list, cfg, progress=None) -> list[dict]:
    """Records of ``cases`` (``retrieval.Case``) in their order, ``task.batch_size`` at a time;
    ``progress(n)`` is called after every ``n`` cases."""
    from kvcompress.harness.tasks.retrieval import case_prompt, case_record, eos_ids, run_case

    size, tick = batch_size(cfg), progress or (lambda n: None)
    if size == 1:
        records = []
        for case in cases:
            records.append(run_case(model, tokenizer, policy, case, cfg))
            tick(1)
        return records
    prompts = [case_prompt(tokenizer, c, cfg) for c in cases]
    records: list = [None] * len(cases)
    stop = eos_ids(model, tokenizer)
    for idx in batches([tail.shape[1] for _, tail in prompts], size):
        heads, tails = [prompts[i][0] for i in idx], [prompts[i][1] for i in idx]
        stream, out = answer_batch(
            model, policy, heads, tails, cfg.question_in_prompt, cfg.max_new_tokens, stop, tokenizer
        )
        asked = cfg.question_in_prompt
        prompt = max(h.shape[1] + (t.shape[1] if asked else 0) for h, t in zip(heads, tails, strict=True))
        shares = cache_shares(model, policy, stream.cache, len(idx), prompt)  # prompts left-padded to it
        for i, ids in zip(idx, out, strict=True):
            records[i] = {**case_record(tokenizer, cases[i], cfg, *prompts[i], ids), **shares}
        tick(len(idx))
    return records
