"""Several sequences through one policy cache: left padding, per-row positions, and the refusal of layers
that cannot compress a padded row exactly as they would compress it alone.

A left-padded batch (B, W) needs two things a plain forward does not give: an ``attention_mask`` that
grows with every forward (the cache layers read each row's padding from it) and ``position_ids`` that count
each row's own tokens (without them the model numbers slots, and a padded row's RoPE shifts). ``Padded``
holds both. Layers (or their storages) that lay groups or pages out on slots rather than on each row's own
tokens declare ``pads_exactly = False``; ``check_padding`` refuses them by name.
"""

from __future__ import annotations

import torch

from kvcompress.runtime.context_pass import prefill


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of ids (1, n_b) as one batch (B, W) padded on the left, and its mask (B, W) (None: no padding)."""
    width = max(r.shape[-1] for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        n = r.shape[-1]
        ids[b, width - n :], mask[b, width - n :] = r.reshape(-1), 1
    return ids, (None if bool(mask.all()) else mask)


def inexact_layers(cache) -> list[str]:
    """Class names of the cache's layers and stores that declare ``pads_exactly = False``."""
    parts = []
    for layer in cache.layers:
        store = getattr(layer, "store", None)
        parts += [layer, store, getattr(store, "key_store", None), getattr(store, "value_store", None)]
    parts = [p for p in parts if p is not None]  # a split store's key and value stores count too
    return sorted({type(p).__name__ for p in parts if not getattr(p, "pads_exactly", True)})


def check_padding(cache, policy_name: str, field: str) -> None:
    """Refuse a padded batch when a layer would not compress each row exactly as alone; ``field`` names
    the setting that made the batch (``task.batch_size``)."""
    bad = inexact_layers(cache)
    if bad:
        raise ValueError(
            f"{field} > 1 left-pads rows of different lengths, and policy {policy_name!r} ({', '.join(bad)}) "
            "lays its groups or pages out on batch slots, not on each row's own tokens: a padded row would "
            f"not be compressed as if alone. Set {field}=1 for this policy."
        )


class Padded:
    """Feeds a left-padded batch through ``cache``: prompt once, then steps of ``q`` tokens per row."""

    def __init__(self, model, cache, mask: torch.Tensor | None):
        self.model, self.cache, self.mask = model, cache, mask  # mask (B, seen) or None (no padding)

    def _kwargs(self, q: int) -> dict:
        """Mask (B, seen) and each row's positions (B, q) for the last ``q`` slots; {} without padding."""
        if self.mask is None:
            return {}
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -q:]  # (B, q): each row's own count
        dev = self.model.device
        return {"attention_mask": self.mask.to(dev), "position_ids": positions.to(dev)}

    def prompt(self, ids: torch.Tensor, tokenizer=None) -> torch.Tensor:
        """Prefill ``ids`` (B, W), padded as ``mask`` says (plus a context pass where the cache needs one);
        returns the last position's logits (B, 1, V)."""
        kwargs = self._kwargs(ids.shape[1])
        return prefill(self.model, self.cache, ids, tokenizer, **kwargs).logits[:, -1:]

    def snapshot(self) -> tuple:
        """The cache's exact state and the mask so far (``restore`` it before each question)."""
        return self.cache.snapshot(), self.mask

    def restore(self, state: tuple) -> None:
        snapshot, self.mask = state
        self.cache.restore(snapshot)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, q, V) of ``ids`` (B, q) fed after everything so far."""
        if self.mask is not None:
            grown = torch.ones(self.mask.shape[0], ids.shape[1], dtype=self.mask.dtype)
            self.mask = torch.cat([self.mask, grown], dim=1)
        kwargs = self._kwargs(ids.shape[1])
        return self.model(ids.to(self.model.device), cache=self.cache, use_cache=True, **kwargs).logits

    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` (B, n) one token per forward (decode steps); returns the last step's logits."""
        logits = None
        for i in range(ids.shape[1]):
            logits = self.step(ids[:, i : i + 1])
        return logits

    def greedy(self, logits: torch.Tensor, max_new_tokens: int, stop: set[int]) -> list[list[int]]:
        """Greedy tokens per row from ``logits`` (B, q, V) until the row's first ``stop`` id (not kept) or
        ``max_new_tokens``; a row that stopped keeps being fed (its later tokens are discarded) until all
        rows have stopped, so no row's tokens depend on when the others end."""
        rows = [[] for _ in range(logits.shape[0])]
        done = [False] * len(rows)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1)  # (B,)
            for b, token in enumerate(nxt.tolist()):
                done[b] = done[b] or token in stop
                if not done[b]:
                    rows[b].append(token)
            if all(done):
                break
            logits = self.step(nxt[:, None])
        return rows
