"""Random orthogonal rotations of head vectors and the 1-bit sign sketch of a residual.

A rotation spreads a vector's energy evenly over its coordinates, so one scale per group of coordinates fits
every group alike (Zandieh et al., TurboQuant, arXiv 2504.19874). Where ``head_dim`` is a power of two it is a
randomized Hadamard transform, ``x -> H (s * x) / sqrt(D)`` with random signs ``s``: O(D log D) per vector,
``D`` signs held. Elsewhere it is a random orthogonal matrix (the Q of a Gaussian's QR), ``D x D`` held.
Both are orthogonal, so ``q . k`` equals the rotated vectors' product and ``inverse`` undoes ``forward``.

The sketch (Zandieh et al., QJL, arXiv 2406.03482) keeps a residual ``r`` as the signs of ``S r`` for a
Gaussian ``S`` (m, D) and its norm. ``sqrt(pi / 2) / m * |r| * S^T sign(S r)`` is an unbiased estimate of
``r`` over ``S``, so its product with a query is an unbiased estimate of ``q . r`` (``estimate``).

Shapes: vectors (..., D); rotations and sketches work in float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def is_power_of_two(d: int) -> bool:
    return d > 0 and d & (d - 1) == 0


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform of ``x`` (..., D) along its last dim (D a power of two):
    log2(D) butterflies, each ``(a, b) -> (a + b, a - b)`` over halves of blocks."""
    d, h = x.shape[-1], 1
    while h < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], d)
        h *= 2
    return x


class Rotation(NamedTuple):
    """An orthogonal map of (..., D): ``signs`` (D,) float32 for the randomized Hadamard transform, or
    ``matrix`` (D, D) float32 (rows are the rotated basis: ``forward(x) = x @ matrix``)."""

    signs: torch.Tensor | None = None
    matrix: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., D) rotated, float32."""
        x = x.float()
        if self.matrix is not None:
            return x @ self.matrix
        return hadamard(x * self.signs) * (1.0 / math.sqrt(x.shape[-1]))

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``forward``'s inverse: ``y`` (..., D) rotated back, float32."""
        y = y.float()
        if self.matrix is not None:
            return y @ self.matrix.T
        return hadamard(y) * (1.0 / math.sqrt(y.shape[-1])) * self.signs

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.signs, self.matrix) if t is not None]

    def to(self, device) -> Rotation:
        return Rotation(*(None if t is None else t.to(device) for t in (self.signs, self.matrix)))


def random_rotation(dim: int, seed: int, device=None) -> Rotation:
    """A random orthogonal map of ``dim``: randomized Hadamard where ``dim`` is a power of two, else the Q
    of a Gaussian matrix's QR (signs fixed by R's diagonal, so Q is Haar-distributed). Seeded on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    if is_power_of_two(dim):
        signs = torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1
        return Rotation(signs=signs).to(device)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    return Rotation(matrix=q.float()).to(device)


def projection(m: int, dim: int, seed: int, device=None) -> torch.Tensor:
    """The sketch's Gaussian projection ``S`` (m, dim) float32, seeded on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, dim, generator=gen).to(device)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Booleans (..., m), m a multiple of 8, as bytes (..., m / 8): bit ``j`` of byte ``i`` is entry
    ``8 i + j``."""
    shape = positive.shape
    grouped = positive.reshape(*shape[:-1], shape[-1] // 8, 8).to(torch.uint8)
    return (grouped * _BITS.to(positive.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """``pack_signs``' bytes (..., m / 8) as signs +1.0 / -1.0 (..., m) float32."""
    bits = (packed[..., None] & _BITS.to(packed.device)) != 0  # (..., m / 8, 8)
    return bits.reshape(*packed.shape[:-1], -1).float() * 2 - 1


def sketch(residual: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The signs of ``proj @ r`` packed (..., m / 8) uint8 and ``|r|`` (..., 1) float32 of ``residual``
    (..., D)."""
    r = residual.float()
    return pack_signs(r @ proj.T >= 0), r.norm(dim=-1, keepdim=True)


def estimate(packed: torch.Tensor, norm: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """The residual's unbiased estimate (..., D) float32 from its sketch: ``sqrt(pi/2)/m |r| S^T sign``."""
    m = proj.shape[0]
    return (unpack_signs(packed) @ proj) * (norm.float() * (math.sqrt(math.pi / 2) / m))


def sketch_logits(query: torch.Tensor, packed: torch.Tensor, norm: torch.Tensor, proj) -> torch.Tensor:
    """``query`` (B, H, g, D) times each token's residual estimate, from the sketch (B, H, T, m / 8) and norms
    (B, H, T, 1): (B, H, g, T) float32, without building the estimates (``(S q) . sign`` per token)."""
    m = proj.shape[0]
    projected = query.float() @ proj.T  # (B, H, g, m)
    dots = projected @ unpack_signs(packed).transpose(-1, -2)  # (B, H, g, T)
    return dots * (norm.float().transpose(-1, -2) * (math.sqrt(math.pi / 2) / m))
