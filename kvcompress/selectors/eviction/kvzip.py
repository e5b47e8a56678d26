"""KVzip: score each stored pair by the attention it receives while the model reconstructs the context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416.

The reconstruction needs the model, so it is not triggered from inside a forward: after the context's
prefill the caller runs ``kvcompress.compress_context(model, cache, context_ids, tokenizer)`` (the tasks
do it for every policy whose layers say ``needs_context_pass``). Until then a KVzip layer stores every
token, like ``full``, and reports ``tokens_evicted = 0``, so a run that never got its context pass is
flagged as not compressed (``metrics.compression``), never reported as a result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.core.fields import Choice, Int
from kvcompress.core.policy import Shape
from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy
from kvcompress.selectors.eviction.kvzip_scores import max_attention
from kvcompress.selectors.eviction.when import EVICT_AT

SCOPES = ("layer", "model")


class KVzipLayer(EvictionLayer):
    """Scores the context pass (``kvcompress.runtime.context_pass``, whose forwards never enter the cache):
    between ``begin_pass`` and ``end_pass``, ``observe_pass`` keeps the running maximum ``pass_scores``
    (B, H_kv, T) float32, freed when the pass ends. Outside a pass it stores and reads as ``full`` does."""

    needs_context_pass = True
    wants_scores = False  # no scores at decode: the context pass is its only look at attention
    # decode attends as the other eviction layers do (grouped by KV head, no repeated keys; its speed against
    # SDPA is measured in experiments/fused/README.md)
    grouped_decode = True
    # the pass's attention hands back each query's log-sum-exp where its kernel has it (SDPA on a CPU), so
    # the scores need no softmax of their own (``kvzip_scores``)
    observed_probs = "lse"

    def __init__(self, policy, layer_idx, spec, store):
        super().__init__(policy, layer_idx, spec, store)
        self.pass_scores: torch.Tensor | None = None
        self.context_passes = 0

    def reset(self) -> None:
        super().reset()
        self.pass_scores, self.context_passes = None, 0

    def begin_pass(self) -> None:
        self.pass_scores = torch.zeros(*self.store.read()[0].shape[:3], device=self.device)

    def observe_pass(self, query, key, scaling: float, lse, keys_valid, queries_valid) -> None:
        """One reconstruction forward: query (B, H, q, D) over key (B, H_kv, T + q, D) with validity
        ``keys_valid`` (B, h, T + q) and ``queries_valid`` (B, q) or None; ``lse``: each query's log-sum-exp
        (B, H, q) from the attention, or None."""
        stored = self.pass_scores.shape[-1]
        top = max_attention(query, key, scaling, stored, keys_valid, queries_valid, lse=lse)
        torch.maximum(self.pass_scores, top, out=self.pass_scores)

    def context_scores(self) -> torch.Tensor:
        """This pass's scores (B, H_kv, T) for planning: sinks +inf (kept first), padding -inf."""
        scores = self.pass_scores.clone()
        scores.masked_fill_(
            self.first_real(self.policy.sink_tokens, scores.shape[-1], scores.device), math.inf
        )
        if self.valid is not None:
            scores.masked_fill_(~self.valid, -math.inf)
        return scores

    def end_pass(self, evict: bool = True, keep: int | None = None) -> None:
        """Evict to ``keep`` tokens per head (default: the target) by the reconstruction scores; the first
        ``sink_tokens`` real tokens stay. ``evict=False`` (a failed pass) leaves the prefill's cache."""
        scores, self.pass_scores = self.pass_scores, None
        if not evict:
            return
        k = self.target() if keep is None else keep
        if self.stored_length() > k:
            sinks = self.first_real(self.policy.sink_tokens, scores.shape[-1], scores.device)
            self.select(scores, k, pinned=sinks)
        if self.store.flush is not None:  # a quantized store re-encodes what eviction decoded
            self.store.flush(self.valid)
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
        budget_scope: ``layer``: every layer keeps the target in every head; ``model``: the layers share
            the model's total by one ranking of all pairs (``kvzip_budgets``; the paper's non-uniform
            budgets, uniform over a layer's heads so nothing is stored masked), so ``budget`` is the mean.
    """

    layer_class = KVzipLayer
    prefill_only = "its scores come from the context pass after a prefill (a reconstruction of the context)"
    FORMULA = True  # the memory formulas below are this class's own
    TEST_PARAMS = {"budget": 12, "compression_ratio": None, "context_chunk": 16, "sink_tokens": 2,
                   "budget_scope": "layer"}  # fmt: skip
    FUZZ = [
        {**alt, "context_chunk": (1, 40), "sink_tokens": (0, 6), "budget_scope": list(SCOPES)}
        for alt in EvictionPolicy.FUZZ
    ]

    context_chunk: int = Int(512, low=1)
    sink_tokens: int = Int(4, low=0)
    budget_scope: str = Choice("model", SCOPES)
    evict_at: str = Choice("prefill", EVICT_AT)

    def check(self, spec) -> None:
        """The context pass scores full-attention layers; windowed ones keep the model's own window."""
        super().check(spec)
        windowed = [i for i in range(spec.num_layers) if spec.window(i) is not None]
        if windowed and self.apply_to == "all":
            raise ValueError(
                f"kvzip.apply_to=all: layers {windowed} of model {spec.model_type!r} are windowed, and the "
                "context pass scores full-attention layers only: use apply_to=full_attention (the windowed "
                "layers then keep the model's own window)"
            )
        if windowed and len(windowed) == spec.num_layers:
            raise ValueError(
                f"kvzip: every layer of model {spec.model_type!r} is windowed (a sliding window of "
                f"{spec.window(0)} tokens): no full-attention layer is left for the context pass to compress"
            )

    def kept_tokens(self, s: Shape) -> int | None:
        """``compress_context`` after the prefill keeps ``min(n, keep_count(n))``, decode tokens append; None
        with ``budget_scope: model`` (each layer's share depends on the scores; the total stays within)."""
        if self.budget_scope == "model":
            return None
        return min(s.prefill, self.keep_count(s.prefill)) + s.decode
