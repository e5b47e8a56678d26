"""Quest: query-aware page selection over an uncompressed KV cache.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.core.fields import Choice, Float, Int
from kvcompress.core.policy import Policy, Shape
from kvcompress.selectors.pages.block_sparse_layer import BlockSparseLayer

BACKENDS = ("auto", "dense", "cpu", "triton")  # backend: which attention backend reads the pages in place


@dataclass
class BlockSparsePolicy(Policy):
    """Pages of ``block_size`` tokens keep per-channel key min/max; a decode step reads only the pages
    with the highest upper bound of q·k (Quest), plus the first ``sink_blocks`` pages and the newest one.

    Nothing is evicted: memory is the full cache plus the page metadata (1/``block_size`` more). What
    Quest saves is reading: ``stats()`` reports the KV bytes read per decode step and the fraction of
    pages attended. Prefill steps (more than one query) read every token: Quest selects at decode.

    Args:
        block_size: tokens per page.
        top_k_blocks: pages read per decode step (sink and newest pages included).
        read_ratio: if set, read ``ceil(read_ratio * pages)`` pages per step instead of ``top_k_blocks``.
        sink_blocks: first pages of real tokens that are always read.
        backend: which attention backend reads the chosen pages where they lie, in caches without padding.
            ``auto``: the first that serves them (``cpu``: the C++ kernel of
            ``kvcompress.kernels.fused_pages``, float32 CPU caches; ``triton``: CUDA), elsewhere the pages
            are gathered for the model's attention. ``cpu`` or ``triton``: that backend only, a step it
            cannot serve is refused by name. ``dense``: always gather.
    """

    layer_class = BlockSparseLayer
    FORMULA = True  # the memory formulas below are this class's own
    MAX_MEMORY_RATIO = 1.3  # page key min/max: 1/block_size of K+V
    TEST_PARAMS = {"block_size": 4, "top_k_blocks": 3}
    FUZZ = {"block_size": (1, 8), "top_k_blocks": (1, 6)}
    MEMORY_VARIANTS = [{"block_size": 7}]

    block_size: int = Int(16, low=1)
    top_k_blocks: int = Int(16, low=1)
    read_ratio: float | None = Float(None, 0.0, 1.0, low_open=True, null=True)
    sink_blocks: int = Int(1, low=0)
    backend: str = Choice("auto", BACKENDS)

    def __post_init__(self):
        super().__post_init__()
        if self.top_k_blocks < self.sink_blocks + 1:
            raise ValueError(
                f"block_sparse.top_k_blocks={self.top_k_blocks} must be >= sink_blocks + 1 "
                f"= {self.sink_blocks + 1} (sinks and the newest page are always read)"
            )

    def covering(self, n_tokens: int) -> BlockSparsePolicy:
        pages = n_tokens // self.block_size + 2  # +1 when padding shifts the page boundaries
        return dataclasses.replace(
            super().covering(n_tokens), top_k_blocks=max(self.top_k_blocks, pages), read_ratio=None
        )

    def pages_to_read(self, n_pages: torch.Tensor) -> torch.Tensor:
        """Pages read per row and head, given the non-empty pages ``n_pages`` (B, H_kv)."""
        return pages_to_read(n_pages, self.top_k_blocks, self.read_ratio, self.sink_blocks + 1)

    def pages_to_read_count(self, n_pages: int) -> int:
        """``pages_to_read`` for ``n_pages`` non-empty pages in every row and head, on the host (the same
        float32 product as the tensor form, so both round alike)."""
        return pages_to_read_count(n_pages, self.top_k_blocks, self.read_ratio, self.sink_blocks + 1)

    def kept_tokens(self, s: Shape) -> int:
        """Quest evicts nothing: every token is stored."""
        return s.total

    def state_bytes(self, s: Shape, kept: int) -> int:
        """Per-page key min and max (B, H_kv, P, D) x 2 in the model dtype, ``P = ceil(T / block_size)``."""
        return s.kv(math.ceil(s.total / self.block_size))


def pages_to_read_count(n_pages: int, top_k: int, read_ratio: float | None, least: int) -> int:
    """``pages_to_read`` of one count on the host (the same float32 product, so both round alike)."""
    if read_ratio is None:
        return min(top_k, n_pages)
    k = math.ceil(float(np.float32(n_pages) * np.float32(read_ratio)))
    return min(max(k, least), n_pages)


def pages_to_read(n_pages: torch.Tensor, top_k: int, read_ratio: float | None, least: int) -> torch.Tensor:
    """Pages read per row and head (B, H_kv): ``top_k``, or ``ceil(read_ratio * n_pages)`` but at least
    ``least``; never more than the non-empty pages ``n_pages`` (B, H_kv)."""
    if read_ratio is None:
        k = torch.full_like(n_pages, top_k)
    else:
        k = torch.ceil(n_pages * read_ratio).long().clamp(min=least)
    return torch.minimum(k, n_pages)
