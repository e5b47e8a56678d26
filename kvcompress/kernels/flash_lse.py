"""The model's SDPA over a dense read, and each query's log-sum-exp, where SDPA's kernel computes it anyway.

KVzip's reconstruction scores (``selectors.eviction.kvzip_scores``) need each query's softmax normaliser,
which SDPA computes and drops. On a CPU, ``scaled_dot_product_attention`` runs the flash kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` for a masked float query of several tokens, which
returns the log-sum-exp beside the output: called directly, with the additive mask SDPA makes of a boolean
one and the key/value heads repeated as transformers' ``sdpa_attention_forward`` repeats them, it gives
the same output as the ``sdpa`` backend plus the normaliser (``tests/core/test_attention_scores.py``).
Anywhere else ``attention_with_lse`` returns None and the scores compute their own.
"""

from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _served(call, mask) -> bool:
    query = call.query
    return (
        query.device.type == "cpu"
        and query.dtype in _FLOATS
        and query.shape[2] > 1
        and mask is not None
        and mask.dtype == torch.bool
        and call.plain
        and call.kwargs.get("position_bias") is None
        and call.kwargs.get("softcap") is None
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


def attention_with_lse(call, key, value, mask):
    """SDPA's output (B, q, H, D) and log-sum-exp (B, H, q) float32 over key/value (B, H_kv, T, D) under a
    boolean ``mask`` (B or 1, 1 or H, q, T), or None where SDPA's kernel does not return it."""
    if not _served(call, mask):
        return None
    query = call.query
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # (B, H, T, D)
    additive = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, attn_mask=additive, scale=call.scaling
    )
    return out.transpose(1, 2).contiguous(), lse.float()
