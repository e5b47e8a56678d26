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

Scope, refused by name elsewhere: the selectors that evict the prompt once (``evicts: prefill``: snapkv,
pyramidkv's snapkv, expected_attention, kvzip), dense storage, no padding, full-attention layers. A flat
layer takes no second eviction (a later step of several tokens over the budget) and no ``crop``.
"""

from __future__ import annotations

import math

import torch

from kvcompress.core import forward_state

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


def refusal(policy, storage_name: str, window) -> str | None:
    """Why ``adaptive: true`` cannot serve this layer, or None."""
    if policy.evicts != "prefill":
        return (
            f"{policy.name}.adaptive=true: head-adaptive budgets are allocated when the prompt is evicted, "
            f"and {policy.name} evicts at every decode step; use snapkv, pyramidkv, expected_attention or "
            "kvzip"
        )
    if storage_name != "dense":
        return f"{policy.name}.adaptive=true stores each head's own pairs densely: use storage=dense"
    if window is not None:
        return f"{policy.name}.adaptive=true serves full-attention layers only: use apply_to=full_attention"
    return None


class AdaptiveHeads:
    """Mixin of ``EvictionLayer``: the flat layout once ``flatten`` ran (``head_of`` set)."""

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
            raise ValueError(
                f"{self.policy.name}.adaptive=true does not serve padded rows (batch with padding)"
            )
        h, t = self.spec.num_kv_heads, self.stored_length()
        self.store.keep_pairs(pairs)
        self.head_of = (pairs % h).to(torch.int8)[:, None]
        self.track, self.pos, self.grouped_decode = False, None, False
        self.evicted += t - pairs.shape[-1] // h
        return pairs

    def stored_length(self) -> int:
        """Tokens per KV head (the mean, once flat: pairs / H_kv), what budgets compare with."""
        n = self.store.length
        return n // self.spec.num_kv_heads if self.flat else n

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.flat:
            return super().update(key_states, value_states, *args, **kwargs)
        b, h, q, d = key_states.shape
        if forward_state.validity(kwargs.get("forward"), b, q, key_states.device) is not None:
            raise ValueError(
                f"{self.policy.name}.adaptive=true does not serve padded rows (batch with padding)"
            )
        flat = lambda x: x.transpose(1, 2).reshape(b, 1, q * h, d)  # noqa: E731  pair t * H + h
        self.store.append(flat(key_states), flat(value_states))
        heads = torch.arange(h, dtype=torch.int8, device=key_states.device).repeat(q).expand(b, 1, -1)
        self.head_of = self.slots.grow("head_of", self.head_of, heads)
        self.seen, self.step_tokens = self.seen + q, q
        keys, values = self.store.read()
        self._view = (keys.shape[-2], None, None)
        if not self.wants_scores:
            self.end_step()
        return keys.expand(b, h, -1, d), values.expand(b, h, -1, d)

    def attend(self, query, key, value):
        """Each KV head reads its own pairs: (B, H_kv, q, N) membership, causal among the step's pairs."""
        if not self.flat:
            return super().attend(query, key, value)
        n, q, h = key.shape[-2], query.shape[2], key.shape[1]
        self._view = (n, None, None)
        mask = self.head_of[:, :, None, :] == torch.arange(h, device=key.device).view(1, h, 1, 1)
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

    def crop_refusal(self, n: int) -> str | None:
        if self.flat:
            return "its heads keep different numbers of tokens (adaptive: true); crop is not written for that"
        return super().crop_refusal(n)

    def begin_context_pass(self) -> None:
        if self.flat:
            raise ValueError(f"{self.policy.name}.adaptive=true: a second context pass is not supported")
        super().begin_context_pass()

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
