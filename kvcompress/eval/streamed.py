"""Log-likelihoods scored as they stream: each forward's logits are reduced at once to what lm-eval reads.

lm-eval's ``hf`` model concatenates a batch's logits (B, T, V), log-softmaxes the whole tensor and then
reads, per request, the log-probability of each continuation token and whether it is the argmax. Streamed
one token per forward, that tensor is the largest thing the evaluation builds (8 rows of 1445 tokens over
SmolLM2's 49152-word vocabulary: 2.3 GB, built, copied and read once more), and building it took a
quarter of a batch-8 run. Here each forward's (B, c, V) logits are log-softmaxed with lm-eval's call and
kept as two (B, T) tensors: the log-probability of the next input token and the argmax at every
position, plus the whole log-softmax at each row's last position (the one token that is not an input).
Every request then reads the same float values lm-eval would gather, and sums them in the same order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class Scores:
    """What a streamed batch keeps of its logits.

    logprob: (B, T) log-probability of the next input token at each position (the last column and padding
        hold whatever padding gave; never read).
    greedy: (B, T) the argmax token at each position.
    last: (B, V) the log-softmax at each row's last input position (it scores the final continuation token).
    """

    logprob: torch.Tensor
    greedy: torch.Tensor
    last: torch.Tensor


def batch_inputs(rows: list[list[int]], device) -> torch.Tensor:
    """(B, T) token ids of ``rows`` right-padded with 0, as lm-eval pads a causal batch."""
    out = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


def stream(chunks, inps: torch.Tensor, inplens: list[int], softmax_dtype=None, start: int = 0) -> Scores:
    """Score ``inps`` (B, T) from ``chunks``: each forward's logits (B, c, V), in order over the positions
    from ``start`` on (the positions before it, a prompt prefilled and compressed first, are never read).

    ``inplens``: each row's real length; row i's last position is ``inplens[i] - 1``.
    """
    B, T = inps.shape
    following = torch.cat([inps[:, 1:], inps.new_zeros(B, 1)], dim=1)  # (B, T) what each position predicts
    ends = [n - 1 for n in inplens]
    logprob = greedy = last = None
    s = start
    for logits in chunks:
        lsm = F.log_softmax(logits, dim=-1, dtype=softmax_dtype)  # lm-eval's call, on one chunk
        if logprob is None:  # NaN before ``start``: a read there would show
            logprob = lsm.new_full((B, T), float("nan"))
            greedy = torch.empty(B, T, dtype=torch.long, device=lsm.device)
            last = lsm.new_empty(B, lsm.shape[-1])
        c = lsm.shape[1]
        logprob[:, s : s + c] = lsm.gather(2, following[:, s : s + c, None]).squeeze(2)
        greedy[:, s : s + c] = lsm.argmax(dim=-1)
        for i, end in enumerate(ends):
            if s <= end < s + c:
                last[i] = lsm[i, end - s]
        s += c
    return Scores(logprob, greedy, last)


def answer(scores: Scores, row: int, inps: torch.Tensor, inplen: int, cont: list[int]) -> tuple[float, bool]:
    """(log-likelihood, is greedy) of continuation ``cont`` ending at row ``row``'s last position.

    Its tokens but the last must be the row's trailing inputs (lm-eval's requests sharing a context
    plus continuation-but-last are scored on one row); anything else is refused rather than misread.
    """
    n = len(cont)
    start = inplen - n
    tokens = torch.tensor(cont, dtype=torch.long, device=inps.device)
    if start < 0 or not torch.equal(inps[row, start + 1 : inplen], tokens[:-1]):
        raise ValueError(f"continuation of {n} tokens does not end row {row}'s input of {inplen} tokens")
    values = torch.cat([scores.logprob[row, start : inplen - 1], scores.last[row, cont[-1]].reshape(1)])
    is_greedy = torch.equal(scores.greedy[row, start:inplen], tokens)
    return float(values.sum()), is_greedy


def _sort_key(request):
    """lm-eval's order: longest first, then by tokens."""
    toks = request[1] + request[2]
    return -len(toks), tuple(toks)


def _shared_input(request):
    """lm-eval's key for requests scored on one row: context plus continuation-but-last."""
    return request[-2] + request[-1][:-1]


def input_tokens(request, max_length: int) -> list[int]:
    """The tokens lm-eval feeds a causal model for one request: cut on the left, last token dropped."""
    _, context, continuation = request
    if not context or not continuation or len(continuation) > max_length:
        raise ValueError(
            f"a request needs a context and a continuation of at most max_length={max_length} tokens; "
            f"got {len(context)} and {len(continuation)}"
        )
    return (context + continuation)[-(max_length + 1) :][:-1]


def _warn_cut(requests: list, max_length: int) -> None:
    """One warning for the requests longer than the model's window (lm-eval cuts them on the left)."""
    cut = [len(c) + len(k) for _, c, k in requests if len(c) + len(k) > max_length + 1]
    if cut:
        log.warning(
            "%d of %d requests exceed max_length=%d (+1) and lose their first tokens (the longest has %d)",
            len(cut), len(requests), max_length, max(cut),
        )  # fmt: skip


def score_requests(lm, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """lm-eval's ``_loglikelihood_tokens`` for ``lm`` (a ``KVCompressLM``): the same order, batches and
    shared rows, each batch streamed through a fresh policy cache and scored as it streams (``stream``)."""
    from lm_eval.models.utils import Collator
    from tqdm.auto import tqdm

    _warn_cut(requests, lm.max_length)
    group_by = "contexts" if lm.logits_cache else None
    order = Collator(requests, sort_fn=_sort_key, group_by=group_by, group_fn=_shared_input)
    results = []
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
    for batch in order.get_batched(n=int(lm.batch_size)):
        rows = [input_tokens(request, lm.max_length) for request in batch]
        inps = batch_inputs(rows, lm.device)
        # each row's context but its last token (the first scored position is the context's last token)
        prompts = [
            len(row) - len(continuation) for row, (_, _, continuation) in zip(rows, batch, strict=True)
        ]
        scores = lm._stream(inps, [len(row) for row in rows], prompts)
        for i, (key, context, continuation) in enumerate(batch):
            # get_cache expands its last argument for the requests sharing row i: a (1, 1, 1) stand-in
            for key_, cont, _ in order.get_cache(key, context, continuation, inps[i : i + 1, :1, None]):
                result = answer(scores, i, inps, len(rows[i]), cont)
                results.append(result)
                if key_ is not None:
                    lm.cache_hook.add_partial("loglikelihood", key_, result)
                bar.update(1)
    bar.close()
    return order.get_original(results)
