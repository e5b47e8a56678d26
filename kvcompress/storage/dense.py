"""Dense storage: keys and values in the model's dtype, in growable buffers (``buffers.Slots``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.storage import buffers
from kvcompress.storage.base import Storage, Store, reorder_all


class DenseStore(Store):
    """Keys/values ``(B, H_kv, T, D)`` in buffers with a little headroom (appends in place, O(1) eviction
    of one token by moving the newest into its slot)."""

    def __init__(self, config, layer_idx, spec):
        super().__init__(config, layer_idx, spec)
        self.keys = self.values = None
        self.slots = buffers.Slots()

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, keys, values) -> None:
        self.keys = self.slots.extend("keys", self.keys, keys)  # in place when the buffer has room
        self.values = self.slots.extend("values", self.values, values)

    def read(self):
        return self.keys, self.values

    def keep(self, idx) -> None:
        self.keys = self.slots.take("keys", self.keys, idx)
        self.values = self.slots.take("values", self.values, idx)

    def keep_spans(self, spans) -> None:
        self.keys = self.slots.take_spans("keys", self.keys, spans)
        self.values = self.slots.take_spans("values", self.values, spans)

    def drop_one(self, slot) -> bool:
        """Move the newest token into ``slot``; refused under 128 tokens (no headroom: small caches stay
        exact) or for a buffer this store did not allocate."""
        if buffers.headroom(self.keys.shape[2]) == 0:
            return False
        if not (self.slots.owns("keys", self.keys) and self.slots.owns("values", self.values)):
            return False
        b, h, t, _ = self.keys.shape
        rows = torch.arange(b, device=self.keys.device).view(b, 1)
        heads = torch.arange(h, device=self.keys.device).view(1, h)
        j = slot.expand(b, h, 1)[..., 0]  # (B, H_kv)
        for name in ("keys", "values"):
            x = getattr(self, name)
            x[rows, heads, j] = x[:, :, t - 1].clone()  # (B, H_kv, D): the newest token fills the hole
            setattr(self, name, x[:, :, : t - 1])
        return True

    def reorder(self, beam_idx) -> None:
        reorder_all(self, ("keys", "values"), beam_idx)
        self.slots.clear()

    def reset(self) -> None:
        self.keys = self.values = None
        self.slots.clear()

    def tensors(self):
        return [self.keys, self.values]


@dataclass
class DenseStorage(Storage):
    """Every kept token in the model's dtype: what ``full`` and the eviction papers measure."""

    name = "dense"
    store_class = DenseStore
    FORMULA = True  # bytes_for below is this class's own
    FUZZ = {}
