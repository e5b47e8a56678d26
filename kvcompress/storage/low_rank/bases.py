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
FLOOR = 1e-4  # smallest weight eigenvalue kept, relative to the largest


def heads_per_block(basis: str, group_size: int, kv_heads: int) -> int:
    """``g``: KV heads sharing one basis."""
    return {"head": 1, "group": group_size, "joint": kv_heads}[basis]


def block_moments(moment: torch.Tensor, g: int, head_dim: int) -> torch.Tensor:
    """The diagonal blocks (L, H / g, g * D, g * D) of a joint second moment (L, H * D, H * D)."""
    n = g * head_dim
    blocks = moment.shape[-1] // n
    return torch.stack([moment[:, i * n : (i + 1) * n, i * n : (i + 1) * n] for i in range(blocks)], dim=1)


def eigenbasis(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors (..., n, n) as columns by decreasing eigenvalue, and eigenvalues (..., n), float64."""
    values, vectors = torch.linalg.eigh(moment.double())
    return vectors.flip(-1), values.flip(-1).clamp(min=0)


def block_diagonal(per_head: torch.Tensor, g: int) -> torch.Tensor:
    """(L, H, D, D) -> (L, H / g, g * D, g * D): each block's heads on its diagonal (heads do not mix)."""
    n_layers, heads, d, _ = per_head.shape
    out = per_head.new_zeros(n_layers, heads // g, g * d, g * d)
    for h in range(heads):
        b, i = divmod(h, g)
        out[:, b, i * d : (i + 1) * d, i * d : (i + 1) * d] = per_head[:, h]
    return out


def weighted_eigenbasis(moment: torch.Tensor, weight: torch.Tensor):
    """Encoder and decoder (..., n, n) and eigenvalues (..., n) of the rank-r maps minimising ``E[e^T W e]``
    (``weight`` W, e.g. the queries' second moment: the attention-logit error) instead of ``E[|e|^2]``.

    With ``S = W^(1/2)`` (eigenvalues floored at ``FLOOR`` of the largest, so ``S`` inverts stably): the PCA
    ``U`` of ``S k``; coefficients ``enc^T k`` with ``enc = S U``, reconstruction ``dec c`` with
    ``dec = S^-1 U``, exact at full rank.
    """
    lam, vec = torch.linalg.eigh(weight.double())
    lam = lam.clamp(min=float(FLOOR) * lam.amax(-1, keepdim=True)).clamp(min=1e-30)
    s = vec @ torch.diag_embed(lam.sqrt()) @ vec.mT
    s_inv = vec @ torch.diag_embed(lam.rsqrt()) @ vec.mT
    u, eig = eigenbasis(s @ moment.double() @ s)
    return s @ u, s_inv @ u, eig


def bases(calibration: dict, source: str, g: int, head_dim: int, weight: str | None = None):
    """Encoder and decoder (L, G, gD, gD), float32, and eigenvalues (L, G, gD) of moment ``source``
    (``keys_post``, ``keys_pre`` or ``values``) for blocks of ``g`` heads; with ``weight`` (``queries_pre``
    or ``queries_post``) minimising the error it weighs. Plain PCA returns one tensor as both maps.
    Computed once per calibration, source, block size and weight."""
    memo = calibration.setdefault("bases", {})
    key = (source, g, weight)
    if key not in memo:
        moment = block_moments(calibration[source], g, head_dim)
        if weight is None:
            u, eig = eigenbasis(moment)
            u = u.float()
            memo[key] = (u, u, eig)
        else:
            enc, dec, eig = weighted_eigenbasis(moment, block_diagonal(calibration[weight], g))
            memo[key] = (enc.float(), dec.float(), eig)
    return memo[key]


def energy_ranks(eigenvalues: torch.Tensor, energy: float) -> list[int]:
    """Per layer the fewest components whose eigenvalues (L, G, n) hold ``energy`` of the total in every
    block."""
    share = eigenvalues.cumsum(-1) / eigenvalues.sum(-1, keepdim=True).clamp(min=1e-30)
    per_block = (share < energy - 1e-6).sum(-1) + 1  # tolerance: energy=1.0 must reach n exactly
    return per_block.clamp(max=eigenvalues.shape[-1]).amax(-1).tolist()


def error_ranks(eigenvalues: torch.Tensor, per_layer: int, relative: bool) -> list[int]:
    """Spread ``per_layer * L`` components over layers to minimise the summed reconstruction error.

    Each layer keeps at least one component; each further one goes where it removes the most error,
    summed over the layer's blocks: absolute eigenvalues where they are comparable across layers (squared
    attention-logit errors, ``key_objective=logits``), shares of each layer's energy otherwise. Both fall
    with the index, so taking the largest overall is the greedy optimum.
    """
    n_layers, _, n = eigenvalues.shape
    scale = eigenvalues.sum(-1, keepdim=True).clamp(min=1e-30) if relative else 1.0
    gain = (eigenvalues / scale).sum(1)[:, 1:]  # (L, n - 1): what component j + 1 of each layer removes
    extra = min(n_layers * (per_layer - 1), gain.numel())
    chosen = torch.zeros_like(gain, dtype=torch.bool).view(-1)
    chosen[gain.reshape(-1).topk(extra).indices] = True
    return (1 + chosen.view(n_layers, n - 1).sum(-1)).tolist()


def layer_ranks(eigenvalues, g: int, rank: int | None, energy: float | None, allocation: str, relative: bool):
    """Components per block for every layer: ``rank * g`` each (``uniform``), spread by error (``error``,
    the same total; ``relative`` as ``error_ranks``), or the fewest reaching ``energy``."""
    if energy is not None:
        return energy_ranks(eigenvalues, energy)
    if allocation == "error":
        return error_ranks(eigenvalues, rank * g, relative)
    return [rank * g] * eigenvalues.shape[0]
