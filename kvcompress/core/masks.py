"""The causal rule over contiguous positions (the last ``q`` queries of a sequence over its ``t`` keys), and
the validity of stored plus new tokens under padding (``cat_valid``).

The reference eager attention, score windows (``torch_attention.window_scores``) and KVzip's reconstruction
scores build their masks here: a query at position ``t - q + i`` reads keys at positions up to its own. A
policy layer's mask compares tracked absolute positions instead (stored tokens need not be contiguous after
eviction: ``PolicyLayer.attention_mask``).
"""

from __future__ import annotations

import torch


def causal(q: int, t: int, device=None) -> torch.Tensor:
    """(q, T) bool: query ``i`` (at position ``t - q + i``) may read key ``j`` when ``j <= t - q + i``."""
    kpos = torch.arange(t, device=device)
    return kpos[None, :] <= (t - q + torch.arange(q, device=device))[:, None]


def cat_valid(old, new, stored: int, batch: int, q: int, device):
    """Validity (B, h, stored + q) of stored + new tokens, or None while no padding was ever seen."""
    if old is None and new is None:
        return None
    h = 1 if old is None else old.shape[1]
    if old is None:
        old = torch.ones(batch, 1, stored, dtype=torch.bool, device=device)
    new = (
        torch.ones(batch, h, q, dtype=torch.bool, device=device)
        if new is None
        else new[:, None].expand(-1, h, -1)
    )
    return torch.cat([old, new], dim=-1)
