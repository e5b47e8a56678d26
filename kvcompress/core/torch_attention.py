"""Attention written in torch ops, where kvcompress computes it instead of the model's SDPA: with the
probabilities score-based eviction reads (``decode_attention``), from what a store holds
(``attend_by_parts``), and a prefill's window of scores (``window_scores``).

SDPA returns no probabilities, so a policy that ranks tokens by the attention they receive (H2O, TOVA,
block eviction) would pay a second O(T) pass over the keys every decode step. For one query per row
and no mask this module computes the attention itself, grouped by KV head (no repeated keys), and keeps
the probabilities for ``window_scores`` to return instead of recomputing them.
"""

from __future__ import annotations

import torch

from kvcompress.core import kernel_slots
from kvcompress.core.masks import causal


def decode_attention(query, key, value, scaling: float, scores: bool = True):
    """Attention of one query per row over every stored key, softmax in float32.

    Args:
        query: (B, H, 1, D); key, value: (B, H_kv, T, D).
        scores: return the probabilities too (a layer that only attends grouped passes False).

    Returns:
        The output (B, 1, H, D) in the query's dtype, as the models' attention functions return it, and
        the probabilities averaged over each KV group's query heads, (B, H_kv, 1, T) float32, or None.
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
    return out, probs.mean(dim=2, keepdim=True) if scores else None


def attend_by_parts(query, scaling: float, kv_heads: int, key_logits, value_output) -> torch.Tensor:
    """One decode query per row, softmax in float32, from a store's own logits and value sums (a store that
    attends from what it holds: low-rank latents, pages read in place).

    Args:
        query: (B, H, 1, D), H a multiple of ``kv_heads`` (H_kv).
        key_logits: ``f(q)`` for q (B, H_kv, n, D) float32 (scaled): logits (B, G, g * n, T) over every
            stored key, in the block layout (``G`` blocks of ``g`` KV heads).
        value_output: ``f(probs)`` for probs (B, G, g * n, T): the output (B, H_kv, n, D) float32.

    Returns:
        (B, 1, H, D) in the query's dtype, as the models' attention functions return it.
    """
    b, h, _, d = query.shape
    q = query.reshape(b, kv_heads, h // kv_heads, d).float() * scaling  # (B, H_kv, n, D)
    out = value_output(torch.softmax(key_logits(q), dim=-1))  # (B, H_kv, n, D)
    return out.reshape(b, 1, h, -1).to(query.dtype)


# kernels f(query, key, scaling, valid) -> probabilities or None, lent by kvcompress.kernels.backends
WINDOW_SCORERS: list = kernel_slots.lent("window_scores")


def window_scores(query, key, scaling: float, valid=None) -> torch.Tensor:
    """Attention probabilities of a step's last ``w`` queries, averaged over each KV group's query heads.

    Costs O(w x T) (never T x T) and is what score-based eviction (H2O, SnapKV, TOVA, block scoring) reads.

    Args:
        query: (B, H, w, D) the last ``w`` queries of the step; the last one sits at key position T - 1.
        key: (B, H_kv, T, D) the keys this step's attention read (after RoPE).
        scaling: the softmax scale the model uses.
        valid: (B, 1 or H_kv, T) bool, False for padding keys, or None.

    Returns:
        (B, H_kv, w, T) float32 probabilities: causal within the window, padding keys exactly 0, and
        all-zero rows for queries that are themselves padding.
    """
    probs = kernel_slots.first("window_scores", query, key, scaling, valid)  # keys read in their own dtype
    if probs is not None:
        return probs
    b, h, w, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    g = h // h_kv
    q = query.reshape(b, h_kv, g * w, d).float()  # (B, H_kv, g*w, D): query heads of each group, stacked
    logits = torch.matmul(q, key.float().transpose(-1, -2)).view(b, h_kv, g, w, t)  # no per-head key copy
    logits.mul_(scaling)
    if w > 1 or valid is not None:
        allowed = causal(w, t, key.device)  # (w, T)
        if valid is not None:
            allowed = allowed & valid[:, :, None, None, :]  # (B, h, 1, w, T)
        logits.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # fully masked rows (padding queries) become 0
    return probs.mean(dim=2)
