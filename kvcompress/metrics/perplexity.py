"""Decode-mode perplexity: the text streams through the policy cache, so every scored token saw only
what the policy kept. ``chunk_size=1`` is exact; larger chunks let tokens inside a chunk see the whole
chunk (flattering the policy), so the chunk size is always part of the result. Prefix perplexity
(``prefix_tokens``) compresses a prompt in one prefill and scores only the streamed continuation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvcompress.runtime.context_pass import forward_prompt


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
            f"prefix_tokens={prefix_tokens!r} must be null or an integer in [1, {n - 2}]: the text has {n} "
            "tokens and at least one must be scored after the prefix"
        )
    return prefix_tokens


@torch.inference_mode()
def decode_perplexity(
    model,
    input_ids: torch.Tensor,
    cache,
    chunk_size: int = 1,
    explicit_positions: bool = False,
    progress=True,
    prefix_tokens: int | None = None,
    after_prefix=None,
) -> dict:
    """Stream ``input_ids`` (1, N) through ``cache`` in chunks; score each token from what came before.

    Args:
        explicit_positions: pass ``position_ids`` (absolute positions) instead of letting the model
            derive them from ``cache.get_seq_length()``; both must agree for a correct policy.
        prefix_tokens: prefix perplexity: the first ``prefix_tokens`` go through ONE prefill forward (where
            prefill-time policies such as SnapKV compress) and are not scored; the rest streams in
            ``chunk_size`` chunks and only those predictions are scored (N - prefix_tokens - 1 tokens).
        after_prefix: called as ``after_prefix(cache, prefix_ids)`` right after the prefix's prefill (the
            context pass of query-agnostic policies, ``kvcompress.runtime.context_pass``).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    ids = input_ids.to(model.device)
    n = ids.shape[1]
    first = _check_prefix(prefix_tokens, n)
    if first:  # the prefix's own logits saw the uncompressed prefix: not scored
        forward_prompt(model, cache, ids[:, :first], logits_to_keep=1)  # in chunks if the cache asks
        if after_prefix is not None:
            after_prefix(cache, ids[:, :first])
    nll, scored = 0.0, 0
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
    mean = nll / max(scored, 1)
    return {
        "perplexity": math.exp(mean),
        "nll": mean,
        "tokens_scored": scored,
        "chunk_size": chunk_size,
        "prefix_tokens": prefix_tokens,
    }
