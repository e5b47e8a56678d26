"""Decode-mode perplexity: the text streams through the policy cache, so every scored token saw only
what the policy kept. ``chunk_size=1`` is exact; larger chunks let tokens inside a chunk see the whole
chunk (flattering the policy), so the chunk size is always part of the result. Prefix perplexity
(``prefix_tokens``) compresses a prompt in one prefill and scores only the streamed continuation. The result
says whether the policy acted, and a warning names the cause when it did not (``metrics.acted``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvcompress.metrics.idle import idle_cause, policy_acted, prefill_only
from kvcompress.runtime.context_pass import compress_context, forward_prompt, needs_context_pass

AUTO = "auto"  # prefix_tokens: half the text for a policy that acts only at a prefill


class NonFiniteError(RuntimeError):
    """NaN/Inf appeared in logits; carries the token index where it happened."""

    def __init__(self, step: int, what: str = "logits"):
        super().__init__(f"non-finite {what} at token {step}")
        self.step = step


def _check_prefix(prefix_tokens, n: int) -> int:
    """``prefix_tokens`` as an int in [1, n - 2] (at least one token is scored), 0 for None."""
    if prefix_tokens is None:
        return 0
    if (
        isinstance(prefix_tokens, bool)
        or not isinstance(prefix_tokens, int)
        or not 1 <= prefix_tokens <= n - 2
    ):
        raise ValueError(
            f"prefix_tokens={prefix_tokens!r} must be null or an integer in [1, {n - 2}] (or 'auto' in "
            f"decode_perplexity): the text has {n} tokens and at least one must be scored after the prefix"
        )
    return prefix_tokens


def _resolve_prefix(prefix_tokens, cache, n: int) -> int:
    """``prefix_tokens`` as the tokens of the one prefill (0: none). ``"auto"``: half the text (``n // 2``)
    for a cache whose policy acts only on a forward of several tokens or in a context pass after one (SnapKV,
    PyramidKV, expected attention, KVzip: under one-token streaming they never act), else none."""
    if prefix_tokens == AUTO:
        return n // 2 if n >= 4 and prefill_only(cache) else 0
    return _check_prefix(prefix_tokens, n)


@torch.inference_mode()
def decode_perplexity(
    model,
    input_ids: torch.Tensor,
    cache,
    chunk_size: int = 1,
    explicit_positions: bool = False,
    progress=True,
    prefix_tokens: int | str | None = AUTO,
    after_prefix=None,
    tokenizer=None,
    check: bool = True,
) -> dict:
    """Stream ``input_ids`` (1, N) through ``cache`` in chunks; score each token from what came before.

    Args:
        explicit_positions: pass ``position_ids`` (absolute positions) instead of letting the model
            derive them from ``cache.get_seq_length()``; both must agree for a correct policy.
        prefix_tokens: prefix perplexity: the first ``prefix_tokens`` go through ONE prefill forward (where
            prefill-time policies such as SnapKV compress) and are not scored; the rest streams in
            ``chunk_size`` chunks and only those predictions are scored (N - prefix_tokens - 1 tokens).
            ``"auto"`` (default): ``N // 2`` for a policy that acts only at a prefill or in a context pass
            after one (``snapkv``, ``pyramidkv``, ``expected_attention``, ``kvzap``, ``kvzip``), else None
            (every token streamed and scored).
        after_prefix: called as ``after_prefix(cache, prefix_ids)`` right after the prefix's prefill; None:
            the context pass of a query-agnostic policy (``kvzip``, ``runtime.context_pass``) when the cache
            needs one.
        tokenizer: builds the context pass's repeat instruction and chat turn (as the command line does);
            None reconstructs the context without them.
        check: add whether the policy acted (``tokens_evicted``, ``cache_bytes``, ``cache_ratio`` against
            ``full`` on the same tokens, ``read_ratio``, ``compressed``, the storage's and SnapKV window's
            flags) and warn, naming the cause, when it did not (``metrics.acted``).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    ids = input_ids.to(model.device)
    n = ids.shape[1]
    first = _resolve_prefix(prefix_tokens, cache, n)
    if first:  # the prefix's own logits saw the uncompressed prefix: not scored
        forward_prompt(model, cache, ids[:, :first], logits_to_keep=1)  # in chunks if the cache asks
        if after_prefix is not None:
            after_prefix(cache, ids[:, :first])
        elif needs_context_pass(cache):
            compress_context(model, cache, ids[:, :first], tokenizer)
    nll, scored = _stream(model, ids, cache, first, chunk_size, explicit_positions, progress)
    mean = nll / max(scored, 1)
    result = {
        "perplexity": math.exp(mean),
        "nll": mean,
        "tokens_scored": scored,
        "chunk_size": chunk_size,
        "prefix_tokens": first or None,
    }
    if check and hasattr(cache, "stats"):
        fed = {"prefill": first or None, "chunk": chunk_size}  # how the n - 1 consumed tokens came
        result |= policy_acted(model, cache, n - 1, idle_cause(cache, first, chunk_size), **fed)
    return result


def _stream(model, ids, cache, first: int, chunk_size: int, explicit_positions: bool, progress):
    """Summed NLL and tokens scored of ``ids[first:]`` streamed in ``chunk_size`` chunks."""
    n, nll, scored = ids.shape[1], 0.0, 0
    steps = range(first, n - 1, chunk_size)
    for start in tqdm(steps, desc="perplexity", disable=not progress, leave=False):
        chunk = ids[:, start : min(start + chunk_size, n - 1)]
        kwargs = {}
        if explicit_positions:
            kwargs["position_ids"] = torch.arange(start, start + chunk.shape[1], device=ids.device)[None]
        logits = model(chunk, cache=cache, use_cache=True, **kwargs).logits.float()  # (1, c, V)
        if not torch.isfinite(logits).all():
            raise NonFiniteError(start)
        targets = ids[:, start + 1 : start + 1 + chunk.shape[1]]
        nll += F.cross_entropy(logits[0], targets[0], reduction="sum").item()
        scored += targets.shape[1]
    return nll, scored
