"""Knorm: keep the keys with the smallest L2 norm, with no attention score.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430:
keys with a low L2 norm draw high attention, so a layer over its budget keeps, per row and KV head, the keys
of lowest norm. Reference code: kvpress's ``KnormPress`` (the authors' own), whose defaults this follows: the
prompt is ranked once at prefill and decode tokens are appended (``ScorerPress``), nothing is protected (no
recent window), and the norm is taken in float32 so that low-precision keys do not tie. The ranking reads
keys only, so the step asks attention for no probabilities and any backend serves it; over quantized storage
a decode step reads the codes with ``evict_at: prefill`` and a dequantized copy with ``always``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.selectors.eviction.scorer import ScorerPolicy, Step


def knorm_scores(key: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, T) priority of each stored key (B, H_kv, T, D): minus its L2 norm, in at least float32."""
    return -torch.linalg.vector_norm(key, dim=-1, dtype=torch.promote_types(key.dtype, torch.float32))


@dataclass
class KnormPolicy(ScorerPolicy):
    """Keep, per layer and KV head, the ``budget`` (or ``1 - compression_ratio``) keys with the smallest L2
    norm (Devoto et al., arXiv 2406.11430); needs no attention scores. ``evict_at: prefill`` (the default)
    ranks the prompt once, as kvpress's ``KnormPress``; ``always`` evicts at every decode step too."""

    MEMORY_VARIANTS = [
        {"budget": None, "compression_ratio": 0.25},
        {"budget": 10, "compression_ratio": None, "evict_at": "always"},
    ]

    def score(self, step: Step) -> torch.Tensor:
        return knorm_scores(step.keys)
