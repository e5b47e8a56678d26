"""KVzip: score each stored pair by the attention it receives while the model reconstructs the context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416.

The reconstruction needs the model, so it is not triggered from inside a forward: after the context's
prefill the caller runs ``kvcompress.compress_context(model, cache, context_ids, tokenizer)`` (the tasks
do it for every policy whose layers say ``needs_context_pass``). Until then a KVzip layer stores every
token, like ``full``, and reports ``tokens_evicted = 0``, so a run that never got its context pass is
flagged as not compressed (``metrics.compression``), never reported as a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress import attention
from kvcompress.fields import Int
from kvcompress.policies.base import Shape
from kvcompress.policies.eviction import EvictionLayer, EvictionPolicy


def max_attention(query, key, scaling: float, stored: int, key_valid=None, query_valid=None) -> torch.Tensor:
    """The most attention any query of a KV group gives each stored key: (B, H_kv, stored) float32.

    Args:
        query: (B, H, q, D) the reconstruction chunk's queries (after RoPE).
        key: (B, H_kv, stored + q, D) the stored keys followed by the chunk's own keys.
        key_valid: (B, 1 or H_kv, stored + q) bool, False for padding keys, or None.
        query_valid: (B, q) bool, False for the padding that ends a shorter row's chunk, or None.
    """
    b, h, q, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    g = h // h_kv
    logits = torch.matmul(query.reshape(b, h_kv, g * q, d).float(), key.float().mT).view(b, h_kv, g, q, t)
    logits.mul_(scaling)
    kpos = torch.arange(t, device=key.device)
    allowed = kpos[None, :] <= (stored + torch.arange(q, device=key.device))[:, None]  # (q, T): causal
    if key_valid is not None:
        allowed = allowed & key_valid[:, :, None, None, :]  # (B, h, 1, q, T)
    logits.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., :stored].nan_to_num_(0.0)  # (B, H_kv, g, q, stored)
    if query_valid is not None:
        probs.mul_(query_valid[:, None, None, :, None])
    return probs.amax(dim=(2, 3))


def _cat_validity(stored_valid, new_valid, stored: int, b: int, q: int, device):
    """Validity (B, h, stored + q) of the stored keys then a chunk's keys, or None when all are real."""
    if stored_valid is None and new_valid is None:
        return None
    h = 1 if stored_valid is None else stored_valid.shape[1]
    if stored_valid is None:
        stored_valid = torch.ones(b, 1, stored, dtype=torch.bool, device=device)
    new = torch.ones(b, h, q, dtype=torch.bool, device=device) if new_valid is None else new_valid[:, None]
    return torch.cat([stored_valid, new.expand(-1, h, -1)], dim=-1)


class KVzipLayer(EvictionLayer):
    """Between ``begin_context_pass`` and ``end_context_pass`` the layer is in reconstruction mode:
    ``update`` returns the stored keys/values followed by the chunk's own and stores nothing, so the
    reconstruction's tokens never enter the cache; ``observe_attention`` keeps the running maximum
    ``pass_scores`` (B, H_kv, T) float32, freed when the pass ends."""

    needs_context_pass = True

    def __init__(self, policy, layer_idx, spec, store):
        super().__init__(policy, layer_idx, spec, store)
        self.pass_scores: torch.Tensor | None = None
        self._pass_keys = self._pass_queries = None  # this chunk's key / query validity, or None
        self.context_passes = 0

    @property
    def wants_scores(self) -> bool:
        return self.pass_scores is not None

    def reset(self) -> None:
        super().reset()
        self.pass_scores, self.context_passes = None, 0

    def begin_context_pass(self) -> None:
        if not self.is_initialized:
            raise RuntimeError("kvzip: compress_context needs a prefilled cache (no tokens stored yet)")
        if self.window is not None:
            raise ValueError(
                f"kvzip.apply_to=all: layer {self.layer_idx} is a windowed layer (window {self.window}); the "
                "context pass runs on full-attention layers only: use apply_to=full_attention"
            )
        self.pass_scores = torch.zeros(*self.store.read()[0].shape[:3], device=self.device)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pass_scores is None:
            return super().update(key_states, value_states, *args, **kwargs)
        keys, values = self.store.read()  # (B, H_kv, T, D): what the context left, nothing appended
        b, _, q, _ = key_states.shape
        self._pass_queries = attention.new_token_validity(b, q, key_states.device)  # (B, q) or None
        valid = _cat_validity(self.valid, self._pass_queries, keys.shape[-2], b, q, key_states.device)
        self._view = (
            keys.shape[-2] + q,
            valid,
            None,
        )  # causal among the pass's own tokens, after the context
        self._pass_keys = valid
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        stored = self.pass_scores.shape[-1]
        top = max_attention(query, key, scaling, stored, self._pass_keys, self._pass_queries)
        self._pass_keys = self._pass_queries = None
        torch.maximum(self.pass_scores, top, out=self.pass_scores)

    def end_step(self) -> None:
        if self.pass_scores is None:  # a reconstruction step stored nothing: nothing to flush
            super().end_step()

    def end_context_pass(self, evict: bool = True) -> None:
        """Evict to the target by the reconstruction scores; the first ``sink_tokens`` real tokens stay.
        ``evict=False`` (a failed pass) leaves the cache as the prefill left it."""
        scores, self.pass_scores = self.pass_scores, None
        self._pass_keys = self._pass_queries = None
        if not evict:
            return
        k = self.target()
        if self.stored_length() > k:
            sinks = self.first_real(self.policy.sink_tokens, scores.shape[-1], scores.device)
            self.select(scores, k, pinned=sinks)
        self.store.flush(self.valid)  # a quantized store re-encodes what eviction decoded
        self.context_passes += 1

    def stats(self) -> dict:
        return {**super().stats(), "context_passes": self.context_passes}


@dataclass
class KVzipPolicy(EvictionPolicy):
    """Keep, per layer and KV head, the ``budget`` (or ``1 - compression_ratio``) pairs that the context's
    reconstruction attends to most (the maximum over the queries of each KV group), plus the first
    ``sink_tokens``. Scoring runs in ``compress_context`` after the prefill: a repeat prompt plus the context
    is teacher-forced against the cache in chunks of ``context_chunk`` tokens (memory O(chunk x T)), and the
    reconstruction's own keys are never stored. Decode tokens are appended afterwards.

    Args:
        budget / compression_ratio: see ``EvictionPolicy`` (ratio of the tokens held at the context pass).
        context_chunk: context tokens reconstructed per forward pass.
        sink_tokens: first real tokens always kept.
    """

    layer_class = KVzipLayer
    evicts = "prefill"  # once, at the context pass after a prefill
    FORMULA = True  # the memory formulas below are this class's own
    TEST_PARAMS = {"budget": 12, "compression_ratio": None, "context_chunk": 16, "sink_tokens": 2}
    FUZZ = [{**alt, "context_chunk": (1, 40), "sink_tokens": (0, 6)} for alt in EvictionPolicy.FUZZ]

    context_chunk: int = Int(512, low=1)
    sink_tokens: int = Int(4, low=0)

    def kept_tokens(self, s: Shape) -> int:
        """``compress_context`` after the prefill keeps ``min(n, keep_count(n))``; decode tokens append."""
        return min(s.prefill, self.keep_count(s.prefill)) + s.decode
