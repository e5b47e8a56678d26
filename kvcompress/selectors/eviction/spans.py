"""Keep runs of adjacent tokens together: a token ranks with the best token of any run of ``span`` holding it.

A multi-token value (a number's digits, one token each on SmolLM2) is read one token at a time while it is
copied, but attention at prefill marks only some of its tokens (mostly the first: the one the question's
last token wants next). Token-level top-k then keeps the value's head and drops its tail, and the model
answers with a truncated value. Max-pooling the priorities over runs of ``span`` adjacent stored tokens
(a stride-1 max pool of width ``2 * span - 1``) lifts the ``span - 1`` neighbours on each side of every
token to its score, so a run around each hit is kept whole. The pooled values are still scores: they
compare across heads (Ada-KV's budgets) and sum into chunks (``unit: chunk`` ranks chunks of pooled scores).

This is SnapKV's pooling (Li et al., arXiv 2404.14469: a stride-1 pool of the votes, its own
``kernel_size`` and ``pooling``) made a setting of every score-based selector (``EvictionPolicy.span``),
with max pooling so a hit's neighbours are kept with it rather than averaged. ChunkKV (Liu et al., arXiv
2502.00299; ``unit: chunk``) reaches for the same with fixed chunks ranked by their summed scores, which a
value can straddle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def span_pool(scores: torch.Tensor, span: int, free: torch.Tensor | None = None) -> torch.Tensor:
    """The best score (B, h, T) float64 within ``span - 1`` stored tokens of each token, over ``free`` tokens:
    the best token of any run of ``span`` adjacent tokens that holds it.

    Args:
        scores: (B, h, T) per-token priorities (higher is kept).
        span: run length; 1 returns the scores.
        free: (B or 1, 1 or h, T) bool, tokens whose scores are pooled (not sinks, protected windows or
            padding: their own priority is set by the caller), or None for all.
    """
    x = scores.double()
    if span <= 1:
        return x
    if free is not None:
        x = x.masked_fill(~free, -torch.inf)
    b, h, t = x.shape
    pooled = F.max_pool1d(x.reshape(b * h, 1, t), kernel_size=2 * span - 1, stride=1, padding=span - 1)
    return pooled.reshape(b, h, t)
