"""KVzip's budgets shared over layers (``budget_scope: model``): one ranking of every scored pair decides how
many tokens each layer keeps.

Kim et al. (arXiv 2505.23416) keep the pairs above one threshold over all layers and heads. Uneven counts
per head would have to be stored as masked slots (memory held, nothing saved), so here a layer keeps the
same count in every head: the largest any of its heads has above the threshold, and the threshold is the
lowest whose layer sizes still fit the budget. Layers whose reconstruction attention is concentrated
keep more, diffuse ones less; the cache holds at most the uniform budget's bytes.
"""

from __future__ import annotations

import torch


def _sizes(scores: list[torch.Tensor], threshold: float) -> list[int]:
    """Per layer, the most pairs any head holds at or above ``threshold`` (at least 1)."""
    return [max(1, int((s >= threshold).sum(-1).max())) for s in scores]


def shared_budgets(scores: list[torch.Tensor], total: int) -> list[int]:
    """Tokens each layer keeps (every head the same) so that ``sum(size x heads) <= total``.

    Args:
        scores: per layer (H_kv, T_l) scores of one batch row (+inf for pairs that must stay, -inf for
            padding).
        total: pairs the whole row may keep (the uniform budget summed over layers and heads).
    """
    heads = scores[0].shape[0]
    ranked = torch.cat([s.flatten() for s in scores]).sort(descending=True).values
    ranked = ranked[torch.isfinite(ranked) | (ranked > 0)]  # padding (-inf) never sets the threshold
    lo, hi = 0, ranked.numel() - 1  # the largest j whose threshold ranked[j] fits (binary search)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(_sizes(scores, float(ranked[mid]))) * heads <= total:
            lo = mid
        else:
            hi = mid - 1
    return _sizes(scores, float(ranked[lo]))


def plan(layers) -> list[int | None]:
    """Each KVzip layer's kept count after its context pass: None (its own target) with ``budget_scope:
    layer``; shared over the layers with ``model`` (rows of a batch each get a plan; a layer keeps the
    largest, so a batched row may keep more than alone, never less). A ``threshold`` sets no count: each
    layer's heads keep what passes it."""
    if layers[0].policy.budget_scope != "model" or layers[0].policy.threshold is not None:
        return [None] * len(layers)
    scores = [layer.context_scores().float().cpu() for layer in layers]  # (B, H_kv, T_l) each
    heads = scores[0].shape[1]
    total = sum(layer.target() for layer in layers) * heads
    rows = [shared_budgets([s[b] for s in scores], total) for b in range(scores[0].shape[0])]
    return [max(sizes) for sizes in zip(*rows, strict=True)]
