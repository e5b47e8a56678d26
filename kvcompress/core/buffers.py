"""Growable token storage for cache layers: append in place, evict with one fast row copy.

``torch.cat`` on every decode step copies the whole cache (O(T) per token), and ``Tensor.gather`` over
``(B, H, T, D)`` indexes element by element. A layer's keys/values instead live in a buffer with a little
headroom along T (``headroom``: 1/128 of the tokens, so ``memory_bytes()`` is at most 0.8% above the
tokens stored; the headroom is real memory and is counted, since the view keeps the whole buffer alive).
Appends write into the headroom; when it is used up the buffer is reallocated with new headroom
(amortised O(128) tokens per step). Eviction copies the kept rows with one ``index_select`` into a fresh
buffer, so evicted tokens are freed. A layer's per-token state (positions, accumulated scores: (B, h, T))
grows the same way along its last dim (``Slots.grow``).

A buffer is only written in place when the layer allocated it (``Slots`` records the storage pointer) and
the tensor is a leading slice of it, so a tensor handed in by the model is never written to.
"""

from __future__ import annotations

import contextlib
import math

import torch


def writing(x: torch.Tensor):
    """The autograd mode to write ``x`` in place in: an inference tensor under inference mode, any other
    outside it and without grad (an eviction may be settled after the forward). No new context when the
    current mode already is that one (a decode step: entering modes costs more than the write)."""
    inference = x.is_inference()
    if torch.is_inference_mode_enabled() == inference and not torch.is_grad_enabled():
        return contextlib.nullcontext()
    return _mode(inference)


@contextlib.contextmanager
def _mode(inference: bool):
    with torch.no_grad(), torch.inference_mode(inference):
        yield


SPARE = 128  # one spare slot per this many entries


def headroom(n_tokens: int) -> int:
    """Spare token slots allocated with ``n_tokens`` (0 below 128 tokens: small caches stay exact)."""
    return n_tokens // SPARE


def _capacity(x: torch.Tensor, dim: int = 2) -> int:
    """Entries along ``dim`` of the buffer behind ``x`` if ``x`` is a leading slice of it along ``dim``
    (a contiguous buffer cut short there, offset 0), else ``x.shape[dim]``: token slots of (B, H, n, D)
    keys, or entries of a (B, h, n) per-token state with ``dim=-1``."""
    shape, strides, dim = x.shape, x.stride(), dim % x.dim()
    n, others = shape[dim], math.prod(shape[:dim] + shape[dim + 1 :])
    cap, rest = divmod(x.untyped_storage().nbytes(), max(others, 1) * x.element_size())
    if x.storage_offset() or rest or cap < n or others == 0:
        return n
    step = 1
    for i in reversed(range(len(shape))):  # the strides of a contiguous buffer with ``cap`` along ``dim``
        if shape[i] != 1 and strides[i] != step:
            return n
        step *= cap if i == dim else shape[i]
    return cap


class Slots:
    """Per-layer record of the buffers this layer allocated (by name), and the operations on them.

    Each record is the buffer's storage address, its shape (entries along the grown dim: its capacity) and
    strides, so whether a tensor is a leading slice of an owned buffer, and its room, are known without
    reading the storage's layout again on every step."""

    def __init__(self):
        self._owned: dict[str, tuple[int, int, tuple, tuple]] = {}  # name -> (address, dim, shape, strides)

    def clear(self) -> None:
        self._owned.clear()

    def _adopt(self, name: str, buf: torch.Tensor, dim: int) -> None:
        """Record ``buf``, a fresh buffer (its first element at its storage's start), as ``name``'s."""
        self._owned[name] = (buf.data_ptr(), dim % buf.dim(), buf.shape, buf.stride())

    def _alloc(self, name: str, like: torch.Tensor, n: int, dim: int = 2) -> torch.Tensor:
        """A buffer shaped like ``like`` with ``n`` entries and their headroom along ``dim``, owned here."""
        shape = list(like.shape)
        shape[dim] = n + n // SPARE  # ``headroom(n)``, here on the decode step's path
        buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        self._owned[name] = (buf.data_ptr(), dim % buf.dim(), buf.shape, buf.stride())
        return buf

    def owns(self, name: str, x: torch.Tensor) -> bool:
        """Whether ``x`` lives in a buffer this layer allocated (so it may be written in place)."""
        owned = self._owned.get(name)
        return owned is not None and owned[0] == x.untyped_storage().data_ptr()

    def store(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Adopt a foreign tensor as is (no copy): it will never be written in place."""
        self._owned.pop(name, None)
        return x

    def extend(self, name: str, x: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """``x`` (B, H, n, D) followed by ``new`` (B, H, q, D); in place when there is room."""
        return self.grow(name, x, new, dim=2)

    def grow(
        self, name: str, x: torch.Tensor | None, new: torch.Tensor | float, dim: int = -1, q: int = 0
    ) -> torch.Tensor:
        """``x`` followed along ``dim`` by ``new``, or by ``q`` entries of the value ``new``: tokens, or a
        selector's per-token state (positions, accumulated scores, along the last dim). In place when ``x``
        is a leading slice of a buffer allocated here with room, so a decode step does not copy it whole."""
        if x is None:
            if not isinstance(new, torch.Tensor):
                raise TypeError(f"Slots.grow({name!r}): the first entries must be a tensor, not {new!r}")
            return self.store(name, new)
        dim = dim % x.dim()
        shape, stride = x.shape, x.stride()
        n, q = shape[dim], new.shape[dim] if isinstance(new, torch.Tensor) else q
        # room: ``x`` starts at the address of the buffer recorded as ``name`` with its strides (a leading
        # slice of it along ``dim``; a view also cut along another dim at offset 0 grows within its own
        # slots), and q entries are free
        owned = self._owned.get(name)
        if (
            owned is not None
            and dim == owned[1]
            and owned[2][dim] - n >= q
            and x.data_ptr() == owned[0]
            and stride == owned[3]
        ):
            out = x.as_strided((*shape[:dim], n + q, *shape[dim + 1 :]), stride)
            tail = x.as_strided((*shape[:dim], q, *shape[dim + 1 :]), stride, n * stride[dim])
        else:
            out = self._alloc(name, x, n + q, dim).narrow(dim, 0, n + q)
            out.narrow(dim, 0, n).copy_(x)
            tail = out.narrow(dim, n, q)
        inference = out.is_inference()  # a buffer made under inference mode (a context pass) may grow outside
        if torch.is_inference_mode_enabled() != inference or torch.is_grad_enabled():
            with _mode(inference):
                _write(tail, new)
        elif isinstance(new, torch.Tensor):  # a decode step: already in that mode, no context to enter
            tail.copy_(new)
        else:
            tail.fill_(new)
        return out

    def take(self, name: str, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` (B, 1 or H, k) of ``x`` (B, H, T, D), copied into a fresh buffer (x is freed)."""
        k = idx.shape[-1]
        buf = gather_tokens(x, idx, headroom(k))
        self._adopt(name, buf, 2)
        return buf[:, :, :k]

    def take_spans(self, name: str, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Token ranges ``[a, b)`` of ``x`` (B, H, T, D), concatenated into a fresh buffer (x is freed);
        plain slice copies, no index tensor."""
        k = sum(b - a for a, b in spans)
        buf = self._alloc(name, x, k)
        at = 0
        for a, b in spans:
            buf[:, :, at : at + b - a] = x[:, :, a:b]
            at += b - a
        return buf[:, :, :k]


def _write(tail: torch.Tensor, new) -> None:
    if isinstance(new, torch.Tensor):
        tail.copy_(new)
    else:
        tail.fill_(new)


def gather_tokens(x: torch.Tensor, idx: torch.Tensor, extra: int = 0) -> torch.Tensor:
    """Tokens ``idx`` (B, 1 or H, k) of ``x`` (B, H, T, D) as a new contiguous (B, H, k + extra, D).

    One ``index_select`` over rows of D (rather than an element-wise ``gather``); the ``extra``
    trailing slots hold copies of token 0, for the caller to overwrite.
    """
    b, h, t, d = x.shape
    idx = idx.expand(b, h, -1)
    rows = _rows(x)
    if rows is None:  # an arbitrary layout: the element-wise gather
        out = x.gather(2, idx[..., None].expand(-1, -1, -1, d))
        return torch.cat([out, x[:, :, :1].expand(-1, -1, extra, -1)], dim=2) if extra else out
    stride = rows.shape[0] // (b * h)
    if extra:
        idx = torch.cat([idx, idx.new_zeros(b, h, extra)], dim=-1)
    flat = idx + torch.arange(b * h, device=x.device).view(b, h, 1) * stride  # (B, H, k + extra)
    return rows.index_select(0, flat.view(-1)).view(b, h, -1, d)


def gather_pages(x: torch.Tensor, pages: torch.Tensor, block: int) -> torch.Tensor:
    """Whole pages ``pages`` (B, H, k) of ``block`` tokens of ``x`` (B, H, T, D), as new (B, H, k * block, D).

    One ``index_select`` of ``block * D`` contiguous elements per page (an overlapping strided view whose row
    ``r`` starts at token row ``r``): ``block`` times fewer, longer copies than ``gather_tokens``.
    """
    b, h, t, d = x.shape
    if pages.shape[-1] == 0:
        return x.new_empty(b, h, 0, d)
    rows = _rows(x)
    if rows is None:  # an arbitrary layout: token by token
        idx = (pages[..., None] * block + torch.arange(block, device=x.device)).flatten(2)
        return gather_tokens(x, idx)
    stride = rows.shape[0] // (b * h)
    windows = rows.as_strided((rows.shape[0] - block + 1, block * d), (d, 1))  # overlapping page views
    start = pages.expand(b, h, -1) * block + torch.arange(b * h, device=x.device).view(b, h, 1) * stride
    return windows.index_select(0, start.view(-1)).view(b, h, -1, d)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` (B, H, T, D) as (B * H * cap, D) rows of its buffer (cap >= T), or None if not so laid out."""
    b, h, t, d = x.shape
    if x.is_contiguous():
        return x.view(-1, d)
    cap = _capacity(x)
    if cap == t:
        return None
    return x.as_strided((b * h * cap, d), (d, 1))


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view keeps its whole storage alive)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:  # empty: may share a neighbour's address
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
