"""What one layer's attention must read this step, as data: the plan a layer hands the executor.

A layer never calls a kernel. Its step yields a ``Plan``: one read (``Dense`` key/value views and a mask,
``Kivi`` packed codes plus the residual window, ``Rotated`` codes of rotated tokens, ``Latent`` low-rank
parts, ``Pages`` of a cache read in place, or ``Heads``: one such read per group of KV heads) and the query
probabilities its selector needs afterwards (``probs``). A plan is frozen data: it holds tensors and small
values, never a callable. ``kvcompress.core.executor`` picks a backend (``kvcompress.kernels.backends``)
that declares support for the plan, once per plan signature; when none serves a compact read, the attention
hook asks the layer for the same step as a dense read (``kvcompress.core.attention``).

A compact read carries the ``backend`` its storage or selector asks for (their ``backend`` field): ``auto``,
the first backend that serves it, else the same step read dense; or one backend's name, which alone may run
it (``required``: where it does not serve the read, the step is refused by name, never read dense instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.rotation import Rotation

# none: the selector reads no scores; last: the decode query's probabilities, per KV group; lse: each
# query's log-sum-exp (B, H, q) where the backend's kernel computes it anyway, else None (the selector
# computes its own)
PROBS = ("none", "last", "lse")


def _named(read) -> bool:
    """Whether a compact read names the one backend that must run it (``required``)."""
    return read.backend != "auto"


@dataclass(frozen=True)
class Dense:
    """Key/value views (B, H_kv, T, D) and a boolean mask (B or 1, 1 or H, q, T), None for plain causal."""

    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None

    form = "dense"
    backend = "auto"
    required = False


@dataclass(frozen=True)
class Kivi:
    """KIVI packed codes (``storage.quant``): key (codes, scales, zeros) per channel (``key_axis``
    ``channel``, KIVI's layout) or per token (``token``, the layout that evicts exactly), values per token,
    then the residual window (B, H_kv, Tr, D) in full precision. ``backend``: ``quant.backend``."""

    keys: tuple
    values: tuple
    key_res: torch.Tensor
    value_res: torch.Tensor
    bits: int
    group: int
    backend: str = "auto"
    key_axis: str = "channel"

    form = "kivi"
    required = property(_named)


@dataclass(frozen=True)
class Rotated(Kivi):
    """A ``Kivi`` read of per-token codes (``key_axis`` ``token``) of rotated tokens
    (``storage.quant.turbo``): each key and value was turned by ``rotation`` (``core.rotation.Rotation``)
    before it was quantized. Keys may carry their residual's sign sketch over ``projection`` (m, D):
    ``keys[3]`` (B, H_kv, Te, m / 8) uint8 and ``keys[4]`` norms (B, H_kv, Te, 1). The residual window is
    not rotated. Attention turns the query, reads the codes and turns the output back."""

    key_axis: str = "token"
    rotation: Rotation | None = None
    projection: torch.Tensor | None = None

    form = "rotated"


@dataclass(frozen=True)
class Latent:
    """Low-rank latents (``storage.low_rank``) read where they lie, ``G`` blocks of ``g`` KV heads sharing a
    latent per token (``kvcompress.kernels.fused_low_rank.attend`` runs it).

    ``keys``: the encoded keys, coefficients (B, G, Te, R) and for int8 codes their scale (B, G, Te, 1);
    ``key_res`` (B, H_kv, Tr, D) the newest keys, exact; ``key_decoder`` (G, g * D, R) float32. The values
    likewise, or with ``values`` None every value dense in ``value_res`` (B, H_kv, T, D) (keys and values
    held by two stores). Pre-RoPE keys add ``positions`` (B, H_kv, Te) int32 of the encoded keys, the
    layer's ``rope`` (``storage.rope.Rope``: the model's rotation and its shared cos/sin table) and ``seen``,
    the tokens appended so far. ``counts``: the store's counters the attention adds to
    (``rope_kernel_steps``: the C++ kernel computed the pre-RoPE logits). ``backend``:
    ``low_rank.backend``."""

    keys: tuple
    key_res: torch.Tensor
    key_decoder: torch.Tensor
    values: tuple | None
    value_res: torch.Tensor
    value_decoder: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    rope: object = None
    seen: int = 0
    counts: dict | None = None
    backend: str = "auto"

    form = "latent"
    required = property(_named)

    @property
    def kv_heads(self) -> int:
        return self.key_res.shape[1]


@dataclass(frozen=True)
class Pages:
    """Quest's chosen pages read where they lie: ``pages`` (B, H_kv, k) ascending, the newest last, of key
    and value (B, H_kv, T, D) whose first ``total`` slots are stored, pages of ``block`` tokens.
    ``backend``: ``block_sparse.backend``."""

    key: torch.Tensor
    value: torch.Tensor
    pages: torch.Tensor
    block: int
    total: int
    backend: str = "auto"

    form = "pages"
    required = property(_named)


@dataclass(frozen=True)
class Heads:
    """KV heads held in separate stores (``storage.heads``, DuoAttention's retrieval and streaming heads):
    ``parts``, one ``(kv_heads, read)`` per store, ``kv_heads`` the tuple of the layer's KV heads it holds and
    ``read`` its own read (any form but ``Heads``), whose lengths may differ. The query heads of each part's
    KV groups read that part alone; the outputs go back to the model's head order."""

    parts: tuple

    form = "heads"
    backend = "auto"
    required = False


@dataclass(frozen=True)
class Plan:
    """One step's attention: its ``read`` and the ``probs`` its selector needs (``PROBS``). ``grouped``: the
    layer's decode query attends in the grouped form of the eviction layers where a backend offers it, so
    equal kept tokens give equal outputs across selectors. A compact read that no backend serves is read
    dense instead, unless it is ``required`` (then the step is refused by name)."""

    read: Dense | Kivi | Rotated | Latent | Pages | Heads
    probs: str = "none"
    grouped: bool = False

    @property
    def form(self) -> str:
        return self.read.form

    def asks_other(self, backend: str) -> str | None:
        """Why ``backend`` may not run this plan because its read names another backend, or None."""
        asked = self.read.backend
        return None if asked in ("auto", backend) else f"the read asks for backend {asked!r}"


@dataclass(frozen=True)
class Call:
    """What the model's attention module asks besides the plan: the query (B, H, q, D), the softmax scale,
    the module and its keyword arguments, the backend the model was installed with, and whether the
    attention is plain softmax (``plain``: no training dropout, logit soft-capping or learned sinks; the
    attention hook says, ``attention.plain_softmax``)."""

    module: object
    query: torch.Tensor
    scaling: float
    kwargs: dict
    configured: str
    dropout: float = 0.0
    plain: bool = True
