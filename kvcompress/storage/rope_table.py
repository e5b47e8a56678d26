"""The rotary cos/sin of every position, computed once and shared by the layers that rotate alike.

Rotating rebuilt pre-RoPE keys every decode step used to ask the model's rotary module for the cos/sin of
every stored position, in each layer (about 1 ms a layer at 4k tokens on a CPU, as much as attention).
A ``RopeTable`` holds them once by position, for one rotary module and layer type (Gemma 3's local and
global layers differ), and grows as the sequence does. The fused kernel (``kernels/rope_latent.cpp``)
reads a key's row by its position. The table belongs with the model, as the cos/sin buffers transformers'
rotary modules used to hold: it is shared by every layer and every cache built from the same policy, it
depends on no cached token, so it is reported apart (``Store.shared_tensors``: ``rope_table_bytes`` in a
layer's stats, ``shared_bytes`` once in a perplexity run's metrics) and not in a cache's ``memory_bytes()``.

The kernel pairs channel ``e`` with ``e + rotary_dim / 2`` (the "rotate half" layout of Llama, Mistral,
Qwen, Gemma; RoFormer, arXiv 2104.09864). ``matches`` checks on random keys that the model's own
``apply_rotary_pos_emb`` does exactly that with these tables; a model that pairs otherwise (interleaved
pairs) keeps the model-module path.
"""

from __future__ import annotations

import torch

STEP = 1024  # the table grows by whole multiples of this many positions, and by at least an eighth


class RopeTable:
    """``cos``, ``sin`` (P, rotary_dim / 2) float32 on the CPU: row ``p`` for position ``p``."""

    def __init__(self, cos_sin):
        self._cos_sin = cos_sin  # positions (1, 1, n) -> cos, sin (1, n, rotary_dim) float32
        self.cos = self.sin = None
        self._inverse: tuple[torch.Tensor, torch.Tensor] | None = None  # of the current rows, made on demand
        self.pairs_halves = True  # cos/sin repeat their first half: the pairs are (e, e + rotary_dim / 2)

    @property
    def length(self) -> int:
        return 0 if self.cos is None else self.cos.shape[0]

    def covering(self, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` with at least ``stop`` rows (extended when shorter)."""
        if stop > self.length:
            grown = max(stop, self.length + self.length // 8)
            self._fill(-(-grown // STEP) * STEP)
        return self.cos, self.sin

    def inverse(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows that turn a key back (``inverted``), computed once per table size instead of for every
        encoded key (each decode step un-rotates one key per layer)."""
        if self._inverse is None:
            self._inverse = inverted(self.cos, self.sin)
        return self._inverse

    def _fill(self, rows: int) -> None:
        positions = torch.arange(rows, dtype=torch.int32).view(1, 1, rows)
        cos, sin = (t[0] for t in self._cos_sin(positions))  # (P, rotary_dim)
        half = cos.shape[-1] // 2
        repeated = [torch.equal(t[:, :half], t[:, half:]) for t in (cos, sin)]
        self.pairs_halves = all(repeated)
        self.cos, self.sin = cos[:, :half].contiguous(), sin[:, :half].contiguous()
        self._inverse = None  # made again for the new rows on demand (the old ones are freed)

    def tensors(self) -> list[torch.Tensor]:
        tables = [] if self.cos is None else [self.cos, self.sin]
        return tables + ([] if self._inverse is None else list(self._inverse))


def inverted(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin that undo a rotation by ``cos``/``sin``: ``cos / n`` and ``-sin / n`` with
    ``n = cos^2 + sin^2`` (1 for plain RoPE; YaRN scales both by its attention factor)."""
    norm = cos * cos + sin * sin
    return cos / norm, -sin / norm


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernel's rotation in tensor form: x (..., n, D), cos/sin (..., n, half) -> (..., n, D)."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def matches(rope, table: RopeTable, head_dim: int) -> bool:
    """Whether ``rope.rotate`` equals ``rotate_halves`` with ``table`` (float rounding aside) for keys of
    ``head_dim`` channels: the condition for the fused kernel to serve this layer."""
    cos, sin = table.covering(STEP)
    if not table.pairs_halves or 2 * cos.shape[-1] > head_dim:
        return False
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 17, STEP - 1], dtype=torch.int32)
    x = torch.randn(1, 1, len(positions), head_dim, generator=gen)
    try:
        want = rope.rotate_by_module(x, positions.view(1, 1, -1))
    except RuntimeError:  # the model's rotation does not take keys of this width
        return False
    got = rotate_halves(x, cos[positions.long()], sin[positions.long()])
    return bool(torch.allclose(want, got, rtol=1e-5, atol=1e-5))
