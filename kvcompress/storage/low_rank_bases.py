"""Low-rank bases from calibration moments: per head, per group of KV heads, or joint over all of them, and
how many components each layer keeps (a fixed rank, an energy target, or a budget spread by error).

A block of ``g`` KV heads shares one basis over its concatenated channels (g * D): ``g = 1`` is a basis per
head, ``g = H_kv`` one joint basis (xKV, arXiv 2503.18893; Palu's grouped G-LRD, arXiv 2407.21118). A
rank is counted per KV head, so a block keeps ``rank * g`` components and every layout stores the same
bytes per token at the same rank.
"""

from __future__ import annotations

import torch

BLOCKS = ("head", "group", "joint")


def heads_per_block(basis: str, group_size: int, kv_heads: int) -> int:
    """``g``: KV heads sharing one basis."""
    return {"head": 1, "group": group_size, "joint": kv_heads}[basis]


def block_moments(moment: torch.Tensor, g: int, head_dim: int) -> torch.Tensor:
    """The diagonal blocks (L, H / g, g * D, g * D) of a joint second moment (L, H * D, H * D)."""
    n = g * head_dim
    blocks = moment.shape[-1] // n
    return torch.stack([moment[:, i * n : (i + 1) * n, i * n : (i + 1) * n] for i in range(blocks)], dim=1)


def eigenbasis(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors (..., n, n) as columns by decreasing eigenvalue (float32), and eigenvalues (..., n)."""
    values, vectors = torch.linalg.eigh(moment.double())
    return vectors.flip(-1).float(), values.flip(-1).clamp(min=0)


def bases(calibration: dict, source: str, g: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bases (L, G, gD, gD) and eigenvalues (L, G, gD) of moment ``source`` (``keys_post``, ``keys_pre`` or
    ``values``) for blocks of ``g`` heads; computed once per calibration and block size."""
    memo = calibration.setdefault("bases", {})
    if (source, g) not in memo:
        memo[(source, g)] = eigenbasis(block_moments(calibration[source], g, head_dim))
    return memo[(source, g)]


def energy_ranks(eigenvalues: torch.Tensor, energy: float) -> list[int]:
    """Per layer the fewest components whose eigenvalues (L, G, n) hold ``energy`` of the total in every
    block."""
    share = eigenvalues.cumsum(-1) / eigenvalues.sum(-1, keepdim=True).clamp(min=1e-30)
    per_block = (share < energy - 1e-6).sum(-1) + 1  # tolerance: energy=1.0 must reach n exactly
    return per_block.clamp(max=eigenvalues.shape[-1]).amax(-1).tolist()


def error_ranks(eigenvalues: torch.Tensor, per_layer: int) -> list[int]:
    """Spread ``per_layer * L`` components over layers to minimise the summed relative reconstruction error.

    Each layer keeps at least one component; each further one goes where it removes the largest share of
    its layer's energy (summed over the layer's blocks). Shares fall with the index, so taking the largest
    shares overall is the greedy optimum.
    """
    n_layers, _, n = eigenvalues.shape
    share = eigenvalues / eigenvalues.sum(-1, keepdim=True).clamp(min=1e-30)
    gain = share.sum(1)[:, 1:]  # (L, n - 1): what component j + 1 of each layer removes
    extra = min(n_layers * (per_layer - 1), gain.numel())
    chosen = torch.zeros_like(gain, dtype=torch.bool).view(-1)
    chosen[gain.reshape(-1).topk(extra).indices] = True
    return (1 + chosen.view(n_layers, n - 1).sum(-1)).tolist()


def layer_ranks(eigenvalues: torch.Tensor, g: int, rank: int | None, energy: float | None, allocation: str):
    """Components per block for every layer: ``rank * g`` each (``uniform``), spread by error
    (``error``, the same total), or the fewest reaching ``energy``."""
    if energy is not None:
        return energy_ranks(eigenvalues, energy)
    if allocation == "error":
        return error_ranks(eigenvalues, rank * g)
    return [rank * g] * eigenvalues.shape[0]
