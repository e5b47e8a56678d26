"""The causal rule over contiguous positions: the last ``q`` queries of a sequence over its ``t`` keys.

The reference eager attention, score windows (``fused.window_scores``) and KVzip's reconstruction scores
build their masks here: a query at position ``t - q + i`` reads keys at positions up to its own. A policy
layer's mask compares tracked absolute positions instead (stored tokens need not be contiguous after
eviction: ``PolicyLayer.attention_mask``).
"""

from __future__ import annotations

import torch


def causal(q: int, t: int, device=None) -> torch.Tensor:
    """(q, T) bool: query ``i`` (at position ``t - q + i``) may read key ``j`` when ``j <= t - q + i``."""
    kpos = torch.arange(t, device=device)
    return kpos[None, :] <= (t - q + torch.arange(q, device=device))[:, None]
