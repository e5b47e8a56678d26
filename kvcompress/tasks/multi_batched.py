"""multi_niah contexts several at a time (``task.batch_size``): contexts left-padded into one batch,
compressed once, each question asked from the restored batch state (``independent`` mode only).

Rows feed their questions in lockstep, so only contexts whose questions have the same token counts, turn
by turn, share a batch. ``multiturn`` is refused: each turn follows the row's own answer, and answers end
at different steps in different rows. Cache fields per record are as in ``batched``.
"""

from __future__ import annotations

import torch

from kvcompress.tasks.batched import batch_size, batches, cache_shares, padded_stream
from kvcompress.tasks.retrieval import eos_ids

# a context's fields of ``retrieval.cache_fields``
CACHE_FIELDS = ("tokens_evicted", "cache_ratio", "read_ratio", "compressed", "attention_backends")


def run_contexts(model, tokenizer, policy, cfg, grid: list[tuple[int, int]], progress) -> list[dict]:
    """Records of every (length, trial) of ``grid``, in order; ``progress(n)`` after ``n`` contexts."""
    from kvcompress.tasks.multi_niah import context_records, prepare_context, run_context

    size = batch_size(cfg)
    if size == 1:
        records = []
        for length, trial in grid:
            records += run_context(model, tokenizer, policy, cfg, length, trial)
            progress(1)
        return records
    if cfg.mode != "independent":
        raise ValueError(
            f"task.batch_size={size} needs task.mode=independent: in {cfg.mode!r} each turn follows the "
            "row's own answer, which ends at a different step in each row; set task.batch_size=1"
        )
    prepared = [prepare_context(tokenizer, cfg, n, t) for n, t in grid]
    per_cell: list = [None] * len(grid)
    keys = [tuple(turn["first"].shape[1] for turn in turns) for _, _, turns in prepared]
    for idx in batches(keys, size):
        responses, shares = _ask_batch(model, tokenizer, policy, cfg, [prepared[i] for i in idx])
        for i, answers in zip(idx, responses, strict=True):
            ctx, head, _ = prepared[i]
            per_cell[i] = context_records(cfg, ctx, head, grid[i], answers, shares)
        progress(len(idx))
    return [record for records in per_cell for record in records]


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
