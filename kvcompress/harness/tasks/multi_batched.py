"""multi_niah contexts several at a time (``task.batch_size``): contexts left-padded into one batch,
compressed once, each question asked from the restored batch state (``independent`` mode only).

Rows feed their questions in lockstep, so only contexts whose questions have the same token counts, turn
by turn, share a batch. ``multiturn`` is refused: each turn follows the row's own answer, and answers end
at different steps in different rows. Cache fields per record are as in ``batched``.
"""

from __future__ import annotations

import torch

from kvcompress.harness.tasks.batched import batch_size, batches, cache_shares, padded_stream
from kvcompress.harness.tasks.retrieval import eos_ids

# a context's fields of ``retrieval.cache_fields``
CACHE_FIELDS = ("tokens_evicted", "cache_ratio", "read_ratio", "compressed", "attention_backends")


def ask_batches(model, tokenizer, policy, cfg, prepared: list, progress):
    """Every prepared context's answers, ``task.batch_size`` contexts per batch: yields ``(index, answers,
    shares)`` per context (``shares``: its batch cache's fields per row); ``progress(n)`` after each batch."""
    if cfg.mode != "independent":
        raise ValueError(
            f"task.batch_size={batch_size(cfg)} needs task.mode=independent: in {cfg.mode!r} each turn "
            "follows the row's own answer, which ends at a different step in each row; set task.batch_size=1"
        )
    keys = [tuple(turn["first"].shape[1] for turn in turns) for _, _, turns in prepared]
    for idx in batches(keys, batch_size(cfg)):
        responses, shares = _ask_batch(model, tokenizer, policy, cfg, [prepared[i] for i in idx])
        for i, answers in zip(idx, responses, strict=True):
            yield i, answers, shares
        progress(len(idx))


@torch.inference_mode()
def _ask_batch(model, tokenizer, policy, cfg, prepared: list) -> tuple[list[list[str]], dict]:
    """Every question of each prepared context from the restored compressed batch; the answers per row
    and the batch cache's fields per row (``cache_shares``)."""
    stream, ids = padded_stream(model, policy, [head for _, head, _ in prepared])
    stream.prompt(ids, tokenizer)
    state, stop = stream.snapshot(), eos_ids(model, tokenizer)
    answers: list[list[str]] = [[] for _ in prepared]
    for t in range(len(prepared[0][2])):
        stream.restore(state)
        logits = stream.feed(torch.cat([turns[t]["first"] for _, _, turns in prepared], 0))
        for b, out in enumerate(stream.greedy(logits, cfg.max_new_tokens, stop)):
            answers[b].append(tokenizer.decode(out, skip_special_tokens=True))
    shares = cache_shares(model, policy, stream.cache, len(prepared))
    return answers, {k: shares[k] for k in (*CACHE_FIELDS, "batch_rows")}
