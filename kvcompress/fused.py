"""Decode attention that also yields the probabilities score-based eviction reads.

SDPA returns no probabilities, so a policy that ranks tokens by the attention they receive (H2O, TOVA,
block eviction) would pay a second O(T) pass over the keys every decode step. For one query per row
and no mask this module computes the attention itself, grouped by KV head (no repeated keys), and keeps
the probabilities for ``window_scores`` to return instead of recomputing them.
"""

from __future__ import annotations

import torch


def decode_attention(query, key, value, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per row over every stored key, softmax in float32.

    Args:
        query: (B, H, 1, D); key, value: (B, H_kv, T, D).

    Returns:
        The output (B, 1, H, D) in the query's dtype, as the models' attention functions return it, and
        the probabilities averaged over each KV group's query heads, (B, H_kv, 1, T) float32.
    """
    b, h, _, d = query.shape
    h_kv = key.shape[1]
    g = h // h_kv
    q = query.reshape(b, h_kv, g, d)  # (B, H_kv, g, D): the query heads of each group
    if query.dtype == torch.float32:
        logits = torch.matmul(q, key.transpose(-1, -2))  # (B, H_kv, g, T)
    else:
        logits = torch.matmul(q.float(), key.float().transpose(-1, -2))
    probs = torch.softmax(logits.mul_(scaling), dim=-1)  # (B, H_kv, g, T) float32
    out = torch.matmul(probs.to(value.dtype), value)  # (B, H_kv, g, D)
    out = out.reshape(b, 1, h, value.shape[-1])  # (B, 1, H, D)
    return out, probs.mean(dim=2, keepdim=True)
