"""KVzip's score of a stored pair: the most attention any reconstruction query of its KV group gives it.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416.

A probability is ``exp(logit - lse)``, ``lse`` being the query's log-sum-exp over every key it reads, and exp
is increasing, so the most any query gives a key is ``exp(max over queries of (logit - lse))``: no (q, T)
softmax is written. The scores go a block of query rows at a time, each block reduced by ``amax`` while it
is still in cache. When the attention handed over ``lse`` (SDPA's flash kernel on a CPU,
``kvcompress.kernels.flash_lse``), ``logit - lse`` over the stored keys is one matmul: the scaled query with
``-lse`` appended against the key with a 1 appended. Otherwise each block's logits over every key give
its ``lse`` first.
"""

from __future__ import annotations

import torch

from kvcompress.core.masks import causal

QUERY_BLOCK = (
    256  # query rows per matmul: a (256, T) float32 block of logits stays in a CPU's cache at T ~ 2k
)
_INF = float("inf")


def max_attention(
    query, key, scaling: float, stored: int, key_valid=None, query_valid=None, lse=None
) -> torch.Tensor:
    """The most attention any query of a KV group gives each stored key: (B, H_kv, stored) float32.

    Args:
        query: (B, H, q, D) the reconstruction chunk's queries (after RoPE).
        key: (B, H_kv, stored + q, D) the stored keys followed by the chunk's own keys.
        key_valid: (B, 1 or H_kv, stored + q) bool, False for padding keys, or None.
        query_valid: (B, q) bool, False for the padding that ends a shorter row's chunk, or None.
        lse: (B, H, q) each query's log-sum-exp of its scaled logits over the keys it reads (causal within
            the chunk, padding out), as the attention computed it; None: computed here.
    """
    b, h, q, d = query.shape
    h_kv = key.shape[1]
    g = h // h_kv
    rows = query.reshape(b, h_kv, g * q, d).float() * scaling  # (B, H_kv, g*q, D): row j*q + i is query i
    keys = key.float()
    drop = None if query_valid is None else ~query_valid.repeat(1, g)[:, None]  # (B, 1, g*q)
    if lse is None:
        blocks = _from_logits(rows, keys, q, stored, key_valid, drop)
    else:
        blocks = _from_lse(rows, keys, stored, _dropped(lse.reshape(b, h_kv, g * q).float(), drop))
    best = torch.full((b, h_kv, stored), -_INF, device=keys.device)
    for block in blocks:  # (B, H_kv, rows, stored): logit - lse
        torch.maximum(best, block.amax(dim=-2), out=best)
    if key_valid is not None:
        best.masked_fill_(~key_valid[..., :stored], -_INF)
    return best.exp_()


def _dropped(lse, drop):
    """``lse`` with +inf for the rows that give nothing (padding queries, a query that read no key), so
    their ``logit - lse`` is -inf."""
    gone = torch.isneginf(lse) if drop is None else torch.isneginf(lse) | drop
    return lse.masked_fill(gone, _INF)


def _from_lse(rows, keys, stored: int, lse):
    """Blocks of ``logit - lse`` over the stored keys, each one matmul (the query extended by ``-lse``)."""
    b, h_kv, n, _ = rows.shape
    shifted = torch.cat([rows, -lse[..., None]], dim=-1)  # (B, H_kv, g*q, D + 1)
    ones = torch.ones(b, h_kv, stored, 1, device=keys.device)
    stored_keys = torch.cat([keys[:, :, :stored], ones], dim=-1).mT  # (B, H_kv, D + 1, stored)
    for start in range(0, n, QUERY_BLOCK):
        yield torch.matmul(shifted[:, :, start : start + QUERY_BLOCK], stored_keys)


def _from_logits(rows, keys, q: int, stored: int, key_valid, drop):
    """Blocks of ``logit - lse`` over the stored keys, ``lse`` from each block's logits over every key it
    reads: the stored ones and the chunk's up to its own, padding keys out."""
    n = rows.shape[2]
    allowed = causal(q, keys.shape[2], keys.device).repeat(n // q, 1)  # (g*q, T)
    for start in range(0, n, QUERY_BLOCK):
        end = min(n, start + QUERY_BLOCK)
        ok = allowed[start:end] if key_valid is None else allowed[start:end] & key_valid[:, :, None, :]
        logits = torch.matmul(rows[:, :, start:end], keys.mT).masked_fill_(~ok, -_INF)  # (B, H_kv, rows, T)
        lse = _dropped(logits.logsumexp(dim=-1), None if drop is None else drop[..., start:end])
        yield logits[..., :stored].sub_(lse[..., None])
