"""A layer's KV heads in two stores of any storage: DuoAttention's retrieval heads and streaming heads.

Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", arXiv
2410.10819. Each part is an ordinary store of the policy's storage built for its own heads (a model spec with
that many KV heads), so the streaming heads' evicted tokens are really gone while the retrieval heads keep
every token; the two parts may hold different numbers of tokens. A decode step reads each part where it lies
(``core.plan.Heads``); a step of several tokens reads both dense, padded to the longer part, and the layer
masks each head to its own tokens (``selectors.duo``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kvcompress.core.plan import Dense, Heads
from kvcompress.core.storage import Store


class HeadSplitStore(Store):
    """``retrieval`` holds the KV heads ``heads[0]``, ``streaming`` the heads ``heads[1]`` (either part may
    be None when the layer has no head of its kind); keys/values enter and leave as (B, H_kv, T, D)."""

    compact = True
    heads: tuple = ((), ())  # set per layer; the defaults answer for a store described by its class alone
    retrieval: Store | None = None
    streaming: Store | None = None

    def __init__(self, config, layer_idx, spec, heads: tuple[tuple[int, ...], tuple[int, ...]]):
        super().__init__(config, layer_idx, spec)
        self.heads = tuple(tuple(int(h) for h in part) for part in heads)
        self.retrieval, self.streaming = (self._part(config, layer_idx, spec, part) for part in self.heads)

    @staticmethod
    def _part(config, layer_idx, spec, heads) -> Store | None:
        if not heads:
            return None
        group = spec.num_heads // spec.num_kv_heads
        sub = dataclasses.replace(spec, num_kv_heads=len(heads), num_heads=len(heads) * group)
        return config.layer(layer_idx, sub)

    def _parts(self):
        return [
            (h, s) for h, s in zip(self.heads, (self.retrieval, self.streaming), strict=True) if s is not None
        ]

    @property
    def length(self) -> int:
        """The longer part's tokens (the retrieval heads': every token)."""
        return max(store.length for _, store in self._parts())

    def lengths(self) -> list[tuple[tuple[int, ...], int]]:
        """Each part's KV heads and its tokens."""
        return [(heads, store.length) for heads, store in self._parts()]

    @property
    def keeps_exactly(self) -> bool:
        return all(store.keeps_exactly for _, store in self._parts())

    @property
    def fixed_rows(self) -> str | None:
        return next((s.fixed_rows for _, s in self._parts() if s.fixed_rows), None)

    def append(self, keys, values, positions=None) -> None:
        for heads, store in self._parts():
            idx = head_index(heads, keys.device)
            store.append(keys.index_select(1, idx), values.index_select(1, idx), positions)

    def read(self):
        """Keys and values (B, H_kv, T, D) of every head, T the longer part's tokens: a shorter part's heads
        hold their tokens first and zeros after (the layer masks them out)."""
        parts = [(heads, store.read()) for heads, store in self._parts()]
        if len(parts) == 1:
            return parts[0][1]
        t = max(k.shape[-2] for _, (k, _) in parts)
        k0 = parts[0][1][0]
        b, d = k0.shape[0], k0.shape[-1]
        h = sum(len(heads) for heads, _ in parts)
        keys, values = (k0.new_zeros(b, h, t, d) for _ in range(2))
        for heads, (k, v) in parts:
            idx = head_index(heads, k.device)
            keys[:, idx, : k.shape[-2]], values[:, idx, : v.shape[-2]] = k, v
        return keys, values

    def attends_codes(self) -> bool:
        return True

    def compact_read(self) -> Heads:
        """Each part's own compact read where it has one, else its dense keys and values."""
        return Heads(tuple((heads, _read(store)) for heads, store in self._parts()))

    def trim(self, sinks: int, window: int) -> int:
        """Keep the streaming heads' first ``sinks`` and last ``window`` tokens; returns how many left."""
        n = 0 if self.streaming is None else self.streaming.length
        if n <= sinks + window:
            return 0
        self.streaming.keep_spans([(0, sinks), (n - window, n)])
        return n - sinks - window

    def same_lengths(self) -> bool:
        return len({store.length for _, store in self._parts()}) == 1

    def keep(self, idx) -> None:
        """Keep tokens ``idx`` (B, 1 or H_kv, k) of every head: only while both parts hold the same tokens."""
        if not self.same_lengths():
            raise ValueError("duo: the streaming heads hold fewer tokens; a selector cannot evict from both")
        for heads, store in self._parts():
            store.keep(idx if idx.shape[1] == 1 else idx[:, list(heads)])

    def keep_spans(self, spans) -> None:
        if not self.same_lengths():
            raise ValueError("duo: the streaming heads hold fewer tokens; a selector cannot evict from both")
        for _, store in self._parts():
            store.keep_spans(spans)

    def flush(self, valid=None) -> None:
        for _, store in self._parts():
            if store.flush is not None:
                store.flush(valid)

    def crop_refusal(self, n: int) -> str | None:
        if not self.same_lengths():
            return "duo's streaming heads have evicted their older tokens: a crop cannot give them back"
        return next((r for _, s in self._parts() if (r := s.crop_refusal(n))), None)

    def crop_conditions(self) -> list[str]:
        conditions = [c for _, s in self._parts() for c in s.crop_conditions()]
        return list(dict.fromkeys(["before the streaming heads evict", *conditions]))

    def crop(self, n: int) -> None:
        for _, store in self._parts():
            store.crop(n)

    def reorder(self, beam_idx) -> None:
        for _, store in self._parts():
            store.reorder(beam_idx)

    def reset(self) -> None:
        for _, store in self._parts():
            store.reset()

    def tensors(self):
        return [t for _, store in self._parts() for t in store.tensors()]

    def fixed_tensors(self):
        return [t for _, store in self._parts() for t in store.fixed_tensors()]

    def shared_tensors(self):
        return [t for _, store in self._parts() for t in store.shared_tensors()]

    def loaded(self) -> None:
        for _, store in self._parts():
            store.loaded()

    def stats(self) -> dict:
        out = {"storage": self.config.name, "retrieval_heads": len(self.heads[0])}
        return out | {
            "streaming_heads": len(self.heads[1]),
            "tokens_per_part": [n for _, n in self.lengths()],
        }

    def read_device(self) -> torch.device:
        return self._parts()[0][1].read_device()


@functools.cache
def head_index(heads: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``heads`` as an int64 index on ``device``, made once (a decode step builds no index tensor)."""
    return torch.tensor(heads, device=device)


def _read(store: Store):
    """A part's read for a decode step: its compact read where it attends from codes, else dense."""
    if store.attends_codes():
        return store.compact_read()
    return Dense(*store.read(), None)
