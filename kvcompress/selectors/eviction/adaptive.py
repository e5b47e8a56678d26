"""Head-adaptive budgets with real per-head lengths (``adaptive: true`` on the prompt-evicting selectors).

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference", arXiv 2407.11550: a layer's budget (``k`` tokens per KV head, ``H * k`` pairs) is shared among
its KV heads by score, one ranking of every (token, head) pair, so a head whose attention is spread keeps
more and a focused head fewer. A safeguard keeps each head's best ``ceil(adaptive_floor * k)`` tokens
whatever the others score (the paper's guard against starving a head).

Masking evicted pairs would save nothing (kvpress does that). Here the kept pairs are really stored: once a
layer's prompt is evicted adaptively it holds them *flat*, one shared token axis (B, 1, N, D) with N = the
pairs kept, and ``head_of`` (B, 1, N) int8 saying which KV head each pair belongs to (1 byte per pair,
counted). New tokens append their H_kv pairs, token-major. Attention is exact for each head's own tokens:
each KV head reads the shared axis masked to its pairs (``attend``), so it costs H_kv times the reads of a
head's own pairs on a decode step (the bytes held are what shrink; a ragged kernel would remove the extra
reads and is not written yet).

Selectors that evict at every decode step from the decode query's attention (h2o, tova: ``adaptive_decode``)
go on evicting pairs once flat: each pair is scored by its own head's attention, and the ``H_kv * k`` best
pairs of the layer stay (the floor applies at the allocation that made the layer flat, not at each step).

Scope, refused by name elsewhere: those selectors and the ones that evict the prompt once (``evicts:
prefill``: snapkv, pyramidkv's snapkv, expected_attention, kvzip), dense storage, no padding, full-attention
layers. A flat layer takes no step of several tokens that would evict (or, for h2o, score) again, and no
``crop``.
"""

from __future__ import annotations

import functools
import math

import torch

from kvcompress.core import attention
from kvcompress.core.torch_attention import window_scores
from kvcompress.selectors.eviction.when import kept_pairs

SAFE = 1e9  # added to a head's safeguarded tokens: above every score, below pinned tokens (base._BIG)


def allocate(prio: torch.Tensor, k: int, floor: float) -> torch.Tensor:
    """Pair indices (B, N) kept from priorities ``prio`` (B, H, T), ascending, pair ``t * H + h`` being token
    ``t`` of head ``h``: the ``H * min(k, T)`` best pairs over all heads, after each head's best
    ``ceil(floor * k)`` are guaranteed."""
    b, h, t = prio.shape
    k = min(k, t)
    safe = min(k, math.ceil(floor * k))
    prio = prio.double()
    if safe:
        best = prio.topk(safe, dim=-1).indices
        prio = prio.scatter_add(-1, best, torch.full(best.shape, SAFE, dtype=prio.dtype, device=prio.device))
    flat = prio.transpose(1, 2).reshape(b, t * h)  # pair t * H + h
    return flat.topk(h * k, dim=-1).indices.sort(dim=-1).values


def option(policy) -> str:
    """The field that made the layer flat, as a config names it: ``snapkv.adaptive=true``,
    ``snapkv.threshold=0.1``."""
    return (
        f"{policy.name}.adaptive=true" if policy.adaptive else f"{policy.name}.threshold={policy.threshold}"
    )


def refusal(policy, storage_name: str, window) -> str | None:
    """Why the flat layout (``adaptive: true``, or a ``threshold``) cannot serve this layer, or None."""
    if policy.evicts != "prefill" and not type(policy).adaptive_decode:
        return (
            f"{option(policy)}: head-adaptive budgets are allocated when the prompt is evicted, "
            f"and {policy.name} evicts at every decode step from more than its query (use evict_at=prefill, "
            "or pyramidkv, expected_attention, kvzip, h2o or tova)"
        )
    if storage_name != "dense":
        return f"{option(policy)} stores each head's own pairs densely: use storage=dense"
    if window is not None:
        return f"{option(policy)} serves full-attention layers only: use apply_to=full_attention"
    return None


@functools.cache
def variant(layer_class: type) -> type:
    """``layer_class`` (an ``EvictionLayer``) with head-adaptive budgets: built only for ``adaptive: true``,
    so a layer without them runs no line of this module. Named ``Adaptive<Layer>`` in this module (a saved
    cache names its layer's class)."""
    name = f"Adaptive{layer_class.__name__}"
    cls = type(name, (AdaptiveHeads, layer_class), {"__module__": __name__, "__qualname__": name})
    globals()[name] = cls
    return cls


class AdaptiveHeads:
    """Put before an ``EvictionLayer`` class by ``variant``: the flat layout once ``flatten`` ran (``head_of``
    set). Its step reads each head's own pairs (``attend``), so codes are never read in its place."""

    adaptive = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_of: torch.Tensor | None = None  # (B, 1, N) int8 KV head of each stored pair, once flat
        self.grouped_decode = type(self).grouped_decode  # off once flat (the heads' lengths differ)

    @property
    def flat(self) -> bool:
        return self.head_of is not None

    def flatten(self, pairs: torch.Tensor) -> torch.Tensor:
        """Keep only ``pairs`` (B, N) (``allocate``'s indices) and hold them flat; returns them."""
        if self.valid is not None:
            raise ValueError(f"{option(self.policy)} does not serve padded rows (batch with padding)")
        h, t, b = self.spec.num_kv_heads, self.stored_length(), pairs.shape[0]
        self.store.keep_pairs(pairs)

        def flat(x):  # (B, 1 or H, T) per-token state -> (B, 1, N) at the pairs
            x = x.expand(b, h, -1) if x.shape[1] == 1 else x
            return x.transpose(1, 2).reshape(b, 1, -1).gather(-1, pairs[:, None])

        for name in self.per_token:
            setattr(self, name, flat(getattr(self, name)))
        self.pos = flat(self.positions()) if self.needs_positions else None
        self.track = self.needs_positions
        self.head_of = (pairs % h).to(torch.int8)[:, None]
        self.grouped_decode = False
        self.evicted += t - pairs.shape[-1] // h
        return pairs

    def select_heads(self, prio: torch.Tensor, k: int) -> torch.Tensor:
        """``EvictionLayer.select`` with adaptive budgets: one ranking of all (token, head) pairs (Ada-KV)
        makes the layer flat; once flat, a decode step's pairs compete across heads (``flat_select``)."""
        if self.flat:
            return self.flat_select(prio, k)
        return self.flatten(
            allocate(prio.expand(-1, self.spec.num_kv_heads, -1), k, self.policy.adaptive_floor)
        )

    def flat_select(self, prio: torch.Tensor, k: int) -> torch.Tensor:
        """A flat layer's decode-step eviction: the ``H_kv * k`` pairs of highest priority (B, 1, N) stay
        (``EvictionLayer.select``'s priorities: kept-first pairs above every score)."""
        if self.step_tokens > 1 or not type(self.policy).adaptive_decode:
            raise ValueError(
                f"{option(self.policy)}: this layer's heads already hold their own budgets; a "
                "second eviction of the prompt (a later step of several tokens over the budget) is not "
                "supported"
            )
        keep = min(k * self.spec.num_kv_heads, prio.shape[-1])
        return self.keep(prio.topk(keep, dim=-1).indices)

    def flat_threshold(self, prio: torch.Tensor) -> torch.Tensor:
        """A flat layer's eviction by threshold (``when``): the pairs whose priority ``prio`` (B, 1, N) is at
        least the threshold stay (kept-first pairs score above it), and each head's best pair; returns the
        kept indices (B, 1, N'). Its count is read back to the host, once per call."""
        h = self.spec.num_kv_heads
        best = prio.expand(-1, h, -1).masked_fill(~self._members(h), -torch.inf).argmax(dim=-1)  # (B, H_kv)
        keep = (prio[:, 0] >= self.threshold).scatter(-1, best, True)  # (B, N)
        return self.keep(kept_pairs(keep, self.policy.name)[:, None], is_sorted=True)

    def keep(self, idx: torch.Tensor, is_sorted: bool = False) -> torch.Tensor:
        if not self.flat:
            return super().keep(idx, is_sorted)
        idx = idx if is_sorted else idx.sort(dim=-1).values
        evicted, before = self.evicted, self.store.length
        self.head_of = self.head_of.gather(-1, idx)
        out = super().keep(idx, is_sorted=True)
        self.evicted = evicted + (before - idx.shape[-1]) // self.spec.num_kv_heads
        return out

    def drop_one(self, slot) -> bool:
        return False if self.flat else super().drop_one(slot)

    def scores(self, query, key, scaling: float, window: int, probs=None) -> torch.Tensor:
        """Once flat, each pair's attention from its own head's decode query: (B, 1, 1, N)."""
        if not self.flat:
            return super().scores(query, key, scaling, window, probs)
        if query.shape[2] > 1:
            raise ValueError(
                f"{option(self.policy)}: a step of several tokens after the heads took their own "
                "budgets is not supported (its scores would need causal masks over the flat pairs)"
            )
        return window_scores(query, key, scaling, self._members(key.shape[1])).sum(dim=1, keepdim=True)

    def _members(self, h: int) -> torch.Tensor:
        """(B, H_kv, N) bool: which stored pairs each KV head owns."""
        return self.head_of == torch.arange(h, device=self.head_of.device).view(1, h, 1)

    def stored_length(self) -> int:
        """Tokens per KV head (the mean, once flat: pairs / H_kv), what budgets compare with."""
        n = self.store.length
        return n // self.spec.num_kv_heads if self.flat else n

    def step(self, key_states, value_states, positions=None, forward=None):
        if not self.flat:
            return super().step(key_states, value_states, positions, forward)
        b, h, q, d = key_states.shape
        if attention.validity(forward, b, q, key_states.device) is not None:
            raise ValueError(f"{option(self.policy)} does not serve padded rows (batch with padding)")
        flat = lambda x: x.transpose(1, 2).reshape(b, 1, q * h, d)  # noqa: E731  pair t * H + h
        if self.wants_hidden:  # a selector scoring from hidden states (kvzap) reads them in on_append
            self.take_hidden(forward)
        self.on_append(flat(key_states), None)  # the selector's per-pair state grows (H2O's scores)
        self.store.append(flat(key_states), flat(value_states))
        heads = torch.arange(h, dtype=torch.int8, device=key_states.device).repeat(q).expand(b, 1, -1)
        self.head_of = self.slots.grow("head_of", self.head_of, heads)
        if self.track:
            new = torch.arange(self.seen, self.seen + q, dtype=torch.int32, device=key_states.device)
            self.pos = self.slots.grow("pos", self.pos, new.repeat_interleave(h).expand(b, 1, -1))
        self.seen, self.step_tokens = self.seen + q, q
        keys, values = self.store.read()
        self._view = (keys.shape[-2], None, None)
        self.open = self.wants_scores
        if not self.open:
            self.end_step()
        return keys.expand(b, h, -1, d), values.expand(b, h, -1, d)

    def attend(self, query, key, value):
        """Each KV head reads its own pairs: (B, H_kv, q, N) membership, causal among the step's pairs."""
        if not self.flat:
            return super().attend(query, key, value)
        n, q, h = key.shape[-2], query.shape[2], key.shape[1]
        self._view = (n, None, None)
        mask = self._members(h)[:, :, None, :]  # (B, H_kv, 1, N)
        if q > 1:  # the step's pairs (the last q * H) follow their tokens' order
            step = torch.arange(n, device=key.device) - (n - q * h)
            mask = mask & (step.div(h, rounding_mode="floor") <= torch.arange(q, device=key.device)[:, None])
        self.count_read(n // h)
        return key, value, mask

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.flat:
            return super().get_mask_sizes(query_length)
        return self.store.length + query_length * self.spec.num_kv_heads, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.flat:
            self.head_of = self.head_of.index_select(0, beam_idx.to(self.head_of.device))

    def never_crops(self) -> str | None:
        if self.flat:
            return "its heads keep different numbers of tokens (adaptive: true); crop is not written for that"
        return super().never_crops()

    def pass_refusal(self) -> str | None:
        if self.flat:
            return f"{option(self.policy)}: a second context pass is not supported"
        return super().pass_refusal()

    def reset(self) -> None:
        super().reset()
        self.head_of, self.grouped_decode = None, type(self).grouped_decode

    def tensors(self) -> list[torch.Tensor]:
        return [*super().tensors(), self.head_of]

    def stats(self) -> dict:
        out = super().stats()
        if self.flat:
            counts = torch.bincount(self.head_of[0, 0].long(), minlength=self.spec.num_kv_heads)
            out["tokens_per_head"] = counts.tolist()  # row 0's per-head lengths
        return out
