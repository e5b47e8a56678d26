"""Shapes shared by policies, storages and the memory model: the model's and one layer's workload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ModelSpec:
    """What a policy needs to know about the model it compresses."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    model_type: str = "llama"
    layer_types: tuple[str, ...] = ()  # transformers' per-layer attention types ("" = all full attention)
    windows: tuple[int | None, ...] = ()  # the model's own window (sliding) or chunk (chunked) per layer

    def window(self, layer_idx: int) -> int | None:
        """The model's attention window of a layer (tokens a query may see), None for full attention."""
        return self.windows[layer_idx] if self.windows else None

    def chunked(self, layer_idx: int) -> bool:
        """Whether a windowed layer attends within fixed chunks (Llama-4) rather than a sliding window."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == "chunked_attention"


class Shape(NamedTuple):
    """One layer's workload: batch rows, KV/query heads, head_dim, element bytes, prefill/decode tokens."""

    batch: int
    kv_heads: int
    heads: int
    head_dim: int
    dtype_bytes: int
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def kv(self, tokens: int) -> int:
        """Bytes of keys and values of ``tokens`` tokens in the model dtype: (B, H_kv, t, D) x 2."""
        return 2 * self.batch * self.kv_heads * tokens * self.head_dim * self.dtype_bytes

    def per_token(self, nbytes: int, tokens: int) -> int:
        """``nbytes`` per stored token, row and KV head: (B, H_kv, t) x nbytes."""
        return self.batch * self.kv_heads * tokens * nbytes
