"""The one builder of causal masks: the last ``q`` queries of a sequence over its ``t`` keys.

Every mask kvcompress builds (the reference eager attention, score windows, KVzip's reconstruction
scores, a layer's per-position masks) starts from this rule: a query at position ``t - q + i`` reads keys
at positions up to its own.
"""

from __future__ import annotations

import torch


def causal(q: int, t: int, device=None) -> torch.Tensor:
    """(q, T) bool: query ``i`` (at position ``t - q + i``) may read key ``j`` when ``j <= t - q + i``."""
    kpos = torch.arange(t, device=device)
    return kpos[None, :] <= (t - q + torch.arange(q, device=device))[:, None]
