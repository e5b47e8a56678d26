"""Helpers shared by tests: stream tokens through a cache, list every tensor a layer holds."""

from __future__ import annotations

import torch


@torch.inference_mode()
def stream_logits(model, ids, cache, chunk: int):
    """Logits (B, N, V) of ``ids`` fed in chunks of ``chunk`` tokens through ``cache``."""
    out = []
    for s in range(0, ids.shape[1], chunk):
        out.append(model(ids[:, s : s + chunk], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def held_tensors(obj, depth: int = 0):
    """Every tensor reachable from ``obj``'s attributes (lists, tuples, dicts included)."""
    if depth > 3:
        return []
    found = []
    values = vars(obj).values() if hasattr(obj, "__dict__") else obj
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += held_tensors(v, depth + 1)
        elif isinstance(v, dict):
            found += held_tensors(list(v.values()), depth + 1)
    return found
