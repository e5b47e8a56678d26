"""Quest: query-aware page selection over an uncompressed KV cache.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer
from kvcompress.policies.block_sparse_layer import BlockSparseLayer


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
    """

    block_size: int = 16
    top_k_blocks: int = 16
    read_ratio: float | None = None
    sink_blocks: int = 1

    def __post_init__(self):
        self.require_ints(block_size=1, sink_blocks=0, top_k_blocks=1)
        if self.top_k_blocks < self.sink_blocks + 1:
            raise ValueError(
                f"block_sparse.top_k_blocks={self.top_k_blocks} must be >= sink_blocks + 1 "
                f"= {self.sink_blocks + 1} (sinks and the newest page are always read)"
            )
        if self.read_ratio is not None and not 0 < self.read_ratio <= 1:
            raise ValueError(f"block_sparse.read_ratio={self.read_ratio} must be in (0, 1] or null")

    @property
    def name(self) -> str:
        return "block_sparse"

    def covering(self, n_tokens: int) -> BlockSparsePolicy:
        pages = n_tokens // self.block_size + 2  # +1 when padding shifts the page boundaries
        return dataclasses.replace(self, top_k_blocks=max(self.top_k_blocks, pages), read_ratio=None)

    def pages_to_read(self, n_pages: torch.Tensor) -> torch.Tensor:
        """Pages read per row and head, given the non-empty pages ``n_pages`` (B, H_kv)."""
        if self.read_ratio is None:
            k = torch.full_like(n_pages, self.top_k_blocks)
        else:
            k = torch.ceil(n_pages * self.read_ratio).long().clamp(min=self.sink_blocks + 1)
        return torch.minimum(k, n_pages)

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        return BlockSparseLayer(self, layer_idx, spec)
