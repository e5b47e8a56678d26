"""KVzip's score of a stored pair: the most attention any reconstruction query of its KV group gives it.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416.
"""

from __future__ import annotations

import torch

from kvcompress.core.masks import causal


def max_attention(query, key, scaling: float, stored: int, key_valid=None, query_valid=None) -> torch.Tensor:
    """The most attention any query of a KV group gives each stored key: (B, H_kv, stored) float32.

    Args:
        query: (B, H, q, D) the reconstruction chunk's queries (after RoPE).
        key: (B, H_kv, stored + q, D) the stored keys followed by the chunk's own keys.
        key_valid: (B, 1 or H_kv, stored + q) bool, False for padding keys, or None.
        query_valid: (B, q) bool, False for the padding that ends a shorter row's chunk, or None.
    """
    b, h, q, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    g = h // h_kv
    logits = torch.matmul(query.reshape(b, h_kv, g * q, d).float(), key.float().mT).view(b, h_kv, g, q, t)
    logits.mul_(scaling)
    allowed = causal(q, t, key.device)  # (q, T): the chunk follows the stored tokens (t = stored + q)
    if key_valid is not None:
        allowed = allowed & key_valid[:, :, None, None, :]  # (B, h, 1, q, T)
    logits.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., :stored].nan_to_num_(0.0)  # (B, H_kv, g, q, stored)
    if query_valid is not None:
        probs.mul_(query_valid[:, None, None, :, None])
    return probs.amax(dim=(2, 3))
