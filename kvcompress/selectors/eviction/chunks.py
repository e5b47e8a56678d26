"""ChunkKV: keep whole chunks of consecutive tokens, ranked by their summed scores, instead of single tokens.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference",
arXiv 2502.00299. Token-level top-k cuts multi-token facts (a number's digits) apart; ranking chunks keeps
them together. Shared by every score-based selector through ``EvictionLayer.select`` (``unit: chunk``).
"""

from __future__ import annotations

import torch


def chunk_ids(t: int, chunk_size: int, valid: torch.Tensor | None, device) -> torch.Tensor:
    """Chunk of every stored slot (1 or B, 1 or H_kv, T): runs of ``chunk_size`` consecutive stored real
    tokens, oldest first (the sequence's own chunks while nothing was evicted; left padding not counted)."""
    if valid is None:
        return (torch.arange(t, device=device) // chunk_size)[None, None]
    return (valid.cumsum(-1) - 1).clamp(min=0) // chunk_size


def chunk_priority(
    scores: torch.Tensor, chunk_size: int, valid: torch.Tensor | None = None, free: torch.Tensor | None = None
) -> torch.Tensor:
    """A priority (B, h, T) float64 whose top-k is whole chunks, best first, then the best tokens of the
    next chunk: chunks ranked by the sum of their ``free`` tokens' scores, tokens inside a chunk by score.

    Args:
        scores: (B, h, T) per-token votes (higher is kept).
        valid: (B, 1 or h, T) bool, False for padding (scores nothing), or None.
        free: (B or 1, 1 or h, T) bool, tokens that compete (not sinks or protected windows), or None.
    """
    b, h, t = scores.shape
    chunk = chunk_ids(t, chunk_size, valid, scores.device).expand(b, h, t)
    votes = scores.double()
    counted = torch.ones_like(votes, dtype=torch.bool)
    for mask in (valid, free):
        if mask is not None:
            counted = counted & mask
    sums = votes.new_zeros(b, h, int(chunk.max()) + 1).scatter_add_(-1, chunk, votes * counted)
    chunk_rank = sums.argsort(dim=-1, stable=True).argsort(-1)  # 0 = the worst chunk; ties: older is worse
    token_rank = votes.argsort(dim=-1, stable=True).argsort(-1)
    return chunk_rank.gather(-1, chunk).double() * t + token_rank.double()
