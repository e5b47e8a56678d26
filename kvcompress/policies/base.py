"""Shared machinery of every policy: the config dataclass and the cache layer it builds.

A policy is a small dataclass (its fields are its Hydra config); ``layer()`` builds one
transformers ``CacheLayerMixin`` per decoder layer. Layers store ``(B, H_kv, T, D)`` tensors in the
model's dtype and report the absolute position (tokens consumed), never the stored length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcompress import attention
from kvcompress.policies import storage
from kvcompress.policies.storage import Slots


@dataclass(frozen=True)
class ModelSpec:
    """What a policy needs to know about the model it compresses."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    model_type: str = "llama"


@dataclass
class Policy:
    """Base of all policies. Subclasses add fields and implement ``layer``."""

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        raise NotImplementedError

    def require_ints(self, **lows: int) -> None:
        """Refuse any named field that is not an integer (bools excluded) at least its lower bound."""
        for field, low in lows.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{self.name}.{field}={value!r} must be an integer >= {low}")

    def check(self, spec: ModelSpec) -> None:
        """Validate fields against the model (e.g. a group size that must divide head_dim)."""

    def prepare(self, model) -> None:
        """Called by ``build_cache`` before ``layer()``; policies that need the model (calibration) use it."""

    def covering(self, n_tokens: int) -> Policy:
        """A copy whose budget covers ``n_tokens``: it must then behave exactly like ``full``."""
        return self

    @property
    def name(self) -> str:
        return type(self).__name__.removesuffix("Policy").lower()

    def describe(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view keeps its whole storage alive)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class PolicyLayer(CacheLayerMixin):
    """Dense cache layer: stores keys/values ``(B, H_kv, T, D)`` and, once padding appears, a validity mask.

    Subclasses compress in ``compress()`` (called after the step's keys are appended) or in
    ``observe_attention()`` (called by the attention function after it ran, when ``wants_scores``).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    wants_scores = False

    def __init__(self, policy: Policy, layer_idx: int, spec: ModelSpec):
        super().__init__()
        self.policy, self.layer_idx, self.spec = policy, layer_idx, spec
        self.valid: torch.Tensor | None = None  # (B, 1 or H_kv, T) bool; None = no padding stored
        self.seen = 0
        self.evicted = 0
        self._view: tuple[int, torch.Tensor | None] | None = None
        self.slots = Slots()  # growable keys/values buffers (storage.py)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    # -- the transformers contract -------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        """Store this step's keys/values (B, H_kv, q, D); return what this step's attention must see."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        new_valid = attention.new_token_validity(key_states.shape[0], q, key_states.device)
        keys, values, valid = self.append(key_states, value_states, new_valid)
        self._view = (keys.shape[-2], valid)
        self.seen += q
        self.compress()
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.stored_length()
        return stored + query_length, self.seen - stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.valid = None
        self.seen = self.evicted = 0
        self._view = None
        self.slots.clear()
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for name in ("keys", "values", "valid"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, beam_idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot roll back tokens (assisted decoding)")

    # -- storage ------------------------------------------------------------------------------
    def append(self, key_states, value_states, new_valid):
        """Concatenate the new tokens; returns keys, values (B, H_kv, T, D) and validity (B, h, T) or None."""
        b, _, q, _ = key_states.shape
        valid = _cat_valid(self.valid, new_valid, self.stored_length(), b, q, key_states.device)
        self.keys = self.slots.extend("keys", self.keys, key_states)  # in place when the buffer has room
        self.values = self.slots.extend("values", self.values, value_states)
        self.valid = valid
        return self.keys, self.values, valid

    def compress(self) -> None:
        """Apply the policy after a step's tokens were appended (eviction, quantization...)."""

    def stored_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def keep(self, idx: torch.Tensor, is_sorted: bool = False) -> torch.Tensor:
        """Keep only the tokens ``idx`` (B, 1 or H_kv, k); copies so evicted storage is freed.

        Returns the kept indices in stored order (``idx`` sorted unless ``is_sorted`` says it already is).
        """
        before = self.stored_length()
        idx = idx if is_sorted else idx.sort(dim=-1).values
        self.keys, self.values = (
            self.slots.take("keys", self.keys, idx),
            self.slots.take("values", self.values, idx),
        )
        if self.valid is not None:  # shared (B, 1, T) validity turns per head when heads differ
            h = max(self.valid.shape[1], idx.shape[1])
            self.valid = self.valid.expand(-1, h, -1).gather(-1, idx.expand(-1, h, -1))
        self.evicted += before - idx.shape[-1]
        return idx

    def drop_one(self, slot: torch.Tensor) -> bool:
        """Evict token ``slot`` (B, 1 or H_kv, 1) of every row and head by moving the newest token into its
        place: one row copied instead of the whole cache, stored order not kept (only for policies whose
        decisions never depend on it). The hole's slot stays allocated for the next token: one spare slot
        on top of the buffer's headroom. Returns False, doing nothing, when not possible in place: padding
        stored, a cache under 128 tokens (no headroom: small caches stay exact) or a foreign buffer."""
        if self.valid is not None or storage.headroom(self.keys.shape[2]) == 0:
            return False
        if not (self.slots.owns("keys", self.keys) and self.slots.owns("values", self.values)):
            return False
        b, h, t, _ = self.keys.shape
        rows = torch.arange(b, device=self.device).view(b, 1)
        heads = torch.arange(h, device=self.device).view(1, h)
        j = slot.expand(b, h, 1)[..., 0]  # (B, H_kv)
        for name in ("keys", "values"):
            x = getattr(self, name)
            x[rows, heads, j] = x[:, :, t - 1].clone()  # (B, H_kv, D): the newest token fills the hole
            setattr(self, name, x[:, :, : t - 1])
        self.evicted += 1
        return True

    def keep_spans(self, spans: list[tuple[int, int]]) -> None:
        """Keep only the token ranges ``[a, b)`` (the same in every row and head; no padding stored)."""
        before = self.stored_length()
        self.keys = self.slots.take_spans("keys", self.keys, spans)
        self.values = self.slots.take_spans("values", self.values, spans)
        self.evicted += before - self.keys.shape[-2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.valid]

    def memory_bytes(self) -> int:
        return storage_bytes(self.tensors())

    def stats(self) -> dict:
        return {
            "layer": self.layer_idx,
            "policy": self.policy.name,
            "tokens_seen": self.seen,
            "tokens_stored": self.stored_length(),
            "tokens_evicted": self.evicted,
            "bytes": self.memory_bytes(),
        }

    # -- attention ----------------------------------------------------------------------------
    def attend(self, query, key, value):
        """What this step's query (B, H, q, D) reads: keys/values (B, H_kv, T, D) and a mask."""
        return key, value, self.attention_mask(query.shape[2])

    def observe_attention(self, query, key, scaling: float) -> None:
        """Called after attention when ``wants_scores``; computes only the scores the policy needs."""

    def attention_mask(self, q: int) -> torch.Tensor | None:
        """Boolean mask (B, 1 or H_kv, q, T) for what ``update`` returned, or None for plain causal."""
        total, valid = self._view
        self._view = (total, None) if valid is not None else self._view  # drop the transient reference
        if valid is None and (q == 1 or q == total):
            return None
        kpos = torch.arange(total, device=self.device) - (total - q)
        mask = (kpos[None, :] <= torch.arange(q, device=self.device)[:, None])[None, None]
        if valid is not None:
            mask = mask & valid[:, :, None, :]
            mask = mask | ~mask.any(-1, keepdim=True)  # padding queries: avoid all-masked rows (NaN)
        return mask


def _cat_valid(old, new, stored: int, batch: int, q: int, device):
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
