"""Dense storage: keys and values in the model's dtype, in growable buffers (``buffers.Slots``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core import buffers
from kvcompress.core.storage import KINDS, Storage, Store, reorder_all


class DenseStore(Store):
    """Keys/values ``(B, H_kv, T, D)`` in buffers with a little headroom (appends in place, O(1) eviction
    of one token by moving the newest into its slot)."""

    def __init__(self, config, layer_idx, spec, kinds=KINDS):
        super().__init__(config, layer_idx, spec, kinds)
        self.keys = self.values = None
        self.slots = buffers.Slots()

    @property
    def length(self) -> int:
        first = getattr(self, self.kinds[0])
        return 0 if first is None else first.shape[-2]

    def append(self, keys, values, positions=None) -> None:
        for kind, x in zip(KINDS, (keys, values), strict=True):
            if kind in self.kinds:  # in place when the buffer has room
                setattr(self, kind, self.slots.grow(kind, getattr(self, kind), x, dim=2))

    def read(self):
        return self.keys, self.values

    def keep(self, idx) -> None:
        for kind in self.kinds:
            setattr(self, kind, self.slots.take(kind, getattr(self, kind), idx))

    def keep_pairs(self, pairs) -> None:
        """Keep the (token, head) pairs ``pairs`` (B, N), pair ``t * H + h``, flat: (B, 1, N, D) each (the
        layout of head-adaptive budgets, ``selectors.eviction.adaptive``)."""
        for kind in self.kinds:
            x = getattr(self, kind)
            b, h, t, d = x.shape
            flat = x.transpose(1, 2).reshape(b, 1, t * h, d)  # (B, 1, T * H, D), pair t * H + h
            setattr(self, kind, self.slots.take(kind, flat, pairs[:, None]))

    def keep_spans(self, spans) -> None:
        for kind in self.kinds:
            setattr(self, kind, self.slots.take_spans(kind, getattr(self, kind), spans))

    def drop_one(self, slot) -> bool:
        """Move the newest token into ``slot`` (B, 1 or H_kv, 1); refused where ``can_refill`` is False."""
        if not self.can_refill():
            return False
        self._fill_from_newest(slot)
        return True

    def can_refill(self) -> bool:
        """False under 128 tokens (no headroom: small caches stay exact) or for a buffer this store did not
        allocate (a tensor handed in by the model is never written)."""
        first = getattr(self, self.kinds[0])
        if first is None or buffers.headroom(first.shape[2]) == 0:
            return False
        return all(self.slots.owns(kind, getattr(self, kind)) for kind in self.kinds)

    def refill(self, slot: int) -> None:
        self._fill_from_newest(slot)  # one token's copy, no index tensor

    def _fill_from_newest(self, slot: int | torch.Tensor) -> None:
        """Write the newest token (B, H_kv, 1, D) at ``slot`` (an int, or (B, 1 or H_kv, 1) per row and
        head: one scatter along T) and drop it from the end. May run after the step's forward (a settled
        eviction): an inference tensor is written under inference mode, any other outside it."""
        t = self.length
        for name in self.kinds:
            x = getattr(self, name)
            with buffers.writing(x):
                newest = x[:, :, t - 1 :].clone()  # a clone: ``slot`` may be the newest slot itself
                if isinstance(slot, int):
                    x[:, :, slot : slot + 1] = newest
                else:
                    b, h, _, d = newest.shape
                    x.scatter_(2, slot.expand(b, h, 1)[..., None].expand(b, h, 1, d), newest)
            setattr(self, name, x[:, :, : t - 1])

    def crop_refusal(self, n: int) -> str | None:
        return None

    def crop(self, n: int) -> None:
        """A leading slice of each buffer: the freed slots become headroom for the next appends."""
        t = self.length - n
        for kind in self.kinds:
            setattr(self, kind, getattr(self, kind)[:, :, :t])

    def reorder(self, beam_idx) -> None:
        reorder_all(self, self.kinds, beam_idx)
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
