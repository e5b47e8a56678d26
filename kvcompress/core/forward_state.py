"""What one forward of the model tells its policy cache: its tokens' padding and which layer just stored.

transformers hands the model's keyword arguments down to every attention module, which passes them to
``cache.update(..., kwargs=kwargs)`` and then to the attention function. ``install()`` adds a forward
pre-hook that puts a fresh ``ForwardState`` into those arguments for every forward whose cache is a
kvcompress cache, so the layers and the attention function read this forward's own state: no thread-local
or module global carries a forward's padding or current layer, and nothing survives into the next forward
(a caller's own mask, another model in another thread).
"""

from __future__ import annotations

import torch

KEY = "kvcompress_forward"  # the keyword argument that carries the state through the model


class ForwardState:
    """One forward's padding (``attention_mask`` (B, T) with 0 for padding, or None when every token is
    real) and the layers whose ``update`` ran and whose attention has not run yet."""

    def __init__(self, attention_mask: torch.Tensor | None = None, cache=None):
        if attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2
        ):
            kind = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask)
            )
            raise ValueError(
                f"attention_mask {kind}: a kvcompress cache masks from each layer's own stored tokens and "
                "takes only a 2D padding mask (B, T) with 0 for padding; a 4D or per-layer mask would be "
                "ignored, so it is refused"
            )
        self.padding = attention_mask
        self.cache = cache  # the cache this forward runs with (a layer may look at the next one)
        self._valid: dict = {}  # (q, device) -> validity of the forward's last q tokens, computed once
        self._pending: dict[int, object] = {}

    def new_token_validity(self, batch: int, q: int, device) -> torch.Tensor | None:
        """Validity (B, q) bool of this forward's new tokens, or None when all are real (one check per
        forward, shared by every layer)."""
        pad = self.padding
        if pad is None or pad.shape[0] != batch or pad.shape[-1] < q:
            return None
        key = (q, str(device))
        if key not in self._valid:
            new = pad[:, -q:].to(device=device, dtype=torch.bool)
            self._valid[key] = None if bool(new.all()) else new
        return self._valid[key]

    def stored(self, layer_idx: int, layer) -> None:
        """``layer`` stored this forward's keys and values; the attention call that follows takes it."""
        self._pending[layer_idx] = layer

    def take(self, layer_idx: int):
        """The layer ``layer_idx`` whose attention runs now, or None (no kvcompress layer stored)."""
        return self._pending.pop(layer_idx, None)


def validity(state: ForwardState | None, batch: int, q: int, device) -> torch.Tensor | None:
    """``state.new_token_validity``; None without a state (a layer driven by hand, outside a model)."""
    return None if state is None else state.new_token_validity(batch, q, device)


def pre_hook(module, args, kwargs):
    """Forward pre-hook (``with_kwargs=True``): a fresh ``ForwardState`` for a forward with a kvcompress
    cache, built from its ``attention_mask``; an outer module's state (the causal-LM wrapper's) is kept."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not getattr(cache, "takes_forward_state", False) or KEY in kwargs:
        return None
    mask = kwargs.get("attention_mask")
    if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
        mask = args[1]  # model(input_ids, attention_mask, ...) positionally
    return args, {**kwargs, KEY: ForwardState(mask, cache)}
