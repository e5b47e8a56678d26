"""The layout of low-rank latents, shared by the store that writes them (``kvcompress.storage.low_rank``)
and the attention that reads them (``kvcompress.kernels.fused_low_rank``).

A block of ``g`` KV heads keeps one latent per token (R components); the block's basis maps the ``g * D``
channels of its heads together, so tokens are encoded and rebuilt with those channels side by side.
"""

from __future__ import annotations

import torch


def to_blocks(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """(B, H, n, D) -> (B, blocks, n, g * D): the channels of each block's g heads side by side."""
    b, h, n, d = x.shape
    return x.reshape(b, blocks, h // blocks, n, d).transpose(2, 3).reshape(b, blocks, n, h // blocks * d)


def from_blocks(y: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, G, n, g * D) -> (B, heads, n, D): the inverse of ``to_blocks``."""
    b, blocks, n, gd = y.shape
    g = heads // blocks
    return y.reshape(b, blocks, n, g, gd // g).transpose(2, 3).reshape(b, heads, n, gd // g)


def coefficients(parts: tuple) -> torch.Tensor:
    """Latents (B, G, n, R) float32 of stored ``parts``: coefficients, or int8 codes times their scale."""
    return parts[0].float() if len(parts) == 1 else parts[0].float() * parts[1].float()


def rebuild(parts: tuple, decoder: torch.Tensor, heads: int) -> torch.Tensor:
    """Tokens (B, heads, n, D) float32 of stored ``parts`` and the block decoder (G, g * D, R), before any
    rotation."""
    return from_blocks(coefficients(parts) @ decoder.mT, heads)
