"""Retention of a span of prompt tokens (a needle's answer) in what a compressed cache holds or reads.

Per decoder layer and KV head, a cache holds (or, for a page-reading selector, reads) a set of absolute
positions. For a span of positions (the answer's own tokens, ``harness.tasks.long_values``):

- ``share``: the fraction of the span's tokens held, averaged over (layer, KV head) pairs;
- ``whole_rate``: the fraction of (layer, KV head) pairs that hold every token of the span;
- ``whole_everywhere``: whether every pair holds it whole (per sample: 1 or 0);
- ``pairs_partial`` / ``pairs_none``: the fraction of pairs holding some but not all of it / none of it.

A pair that holds part of a multi-token value gives the model a truncated value to copy from; one that
holds none gives it nothing. The two call for different fixes, so both are counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcompress.metrics.fidelity import read_set


def span_hits(held: Sequence[torch.Tensor], span: Sequence[int], heads: int) -> torch.Tensor:
    """How many of ``span``'s positions each layer and KV head holds: (L, heads) int64 (``span_found``)."""
    return span_found(held, span, heads).sum(-1)


def span_found(held: Sequence[torch.Tensor], span: Sequence[int], heads: int) -> torch.Tensor:
    """Which of ``span``'s positions each layer and KV head holds: (L, heads, n) bool.

    Args:
        held: per layer, the absolute positions (1, 1 or heads, k) it holds (row 0 of a batch of one; a
            position may repeat, e.g. a token both hot and fetched; negative entries are unused slots).
        span: the positions asked for, distinct.
        heads: KV heads per layer (a layer holding one set for all heads counts it for each).
    """
    want = torch.as_tensor(list(span), dtype=torch.long)
    rows = []
    for pos in held:
        if pos.dim() != 3 or pos.shape[0] != 1 or pos.shape[1] not in (1, heads):
            raise ValueError(
                f"span_hits: held positions must be (1, 1 or {heads}, k); got {tuple(pos.shape)}"
            )
        found = (pos[0].long().cpu()[:, :, None] == want).any(1)  # (1 or heads, n): span token held
        rows.append(found.expand(heads, -1))
    return torch.stack(rows)


def summarize(hits: torch.Tensor, n: int) -> dict[str, float]:
    """Retention numbers of one sample from its ``span_hits`` (L, H) over a span of ``n`` tokens."""
    if n < 1:
        raise ValueError(f"summarize: the span must hold at least one token, got n={n}")
    whole, none = hits == n, hits == 0
    return {
        "share": float(hits.double().mean() / n),
        "whole_rate": float(whole.double().mean()),
        "whole_everywhere": float(whole.all()),
        "pairs_partial": float((~whole & ~none).double().mean()),
        "pairs_none": float(none.double().mean()),
    }


class ReadSets:
    """Watches every layer of ``cache`` (``PolicyLayer.watch``, before the first token) and keeps, per layer,
    the absolute positions the last query of the layer's latest forward could read (1, H_kv, T), -1 where
    it could not: what that forward's next-token prediction was computed from. A context pass's
    reconstruction forwards (KVzip) are not the model's steps and are skipped."""

    def __init__(self, cache):
        self.last: dict[int, torch.Tensor] = {}
        for layer in cache.layers:
            layer.watch(self)

    def stored(self, layer, keys, values) -> None:
        """``PolicyLayer.update`` hands a probe the step's exact keys and values: not needed here."""

    def attended(self, layer, query, key, value, mask, scaling: float, out) -> None:
        pos, allowed = read_set(layer, key, mask)  # (B, H_kv, T)
        self.last[layer.layer_idx] = pos[:1].masked_fill(~allowed[:1], -1)

    def snapshot(self) -> list[torch.Tensor]:
        """Per layer, in order, the positions (1, H_kv, T) its latest forward's last query could read."""
        return [self.last[i] for i in sorted(self.last)]
