"""Quest's decode attention read in place: the chosen pages of a float32 cache, no gathered copy.

The C++ kernel ``kvcompress/kernels/page_attention.cpp`` computes the logits of a GQA group's query heads
over whole pages and the newest page's stored tokens, torch's softmax normalises them, and the kernel sums
the values of the same tokens (Tang et al., "Quest", arXiv 2406.10774, read pages in place on a GPU).
The numbers are those of SDPA over the gathered pages, to float rounding. The same kernel also chooses the
pages (``select``): Quest's bounds, the forced pages and the top ones in one call, as the tensor form does.
"""

from __future__ import annotations

import torch

from kvcompress import kernels
from kvcompress.core.torch_attention import attend_by_parts


def usable(key: torch.Tensor) -> bool:
    """Whether the kernel reads ``key``'s pages in place: a float32 CPU cache with unit stride (built)."""
    if key.dtype != torch.float32 or key.device.type != "cpu" or key.stride(-1) != 1:
        return False
    return kernels.load("page_attention") is not None


def select(query: torch.Tensor, page_min, page_max, sinks: int, width: int) -> torch.Tensor | None:
    """The ``width`` pages (B, H_kv, width) ascending that ``BlockSparseLayer._select_unpadded`` chooses for
    decode queries (B, H, D), from the kernel in one call; None where the tensor form runs instead. Lent to
    the selector through ``kvcompress.core.kernel_slots``."""
    if not (usable(page_min) and page_min.is_contiguous() and page_max.is_contiguous()):
        return None
    b, h, d = query.shape
    q = query.reshape(b, page_min.shape[1], -1, d).float().contiguous()  # (B, H_kv, g, D)
    return kernels.load("page_attention").select_pages(q, page_min, page_max, sinks, width)


def attend(query, scaling: float, key, value, pages: torch.Tensor, block: int, total: int) -> torch.Tensor:
    """Output (B, 1, H, D) of decode queries (B, H, 1, D) over ``pages`` (B, H_kv, k) of key/value
    (B, H_kv, T, D): whole pages ascending, the newest last, of which only ``[.., total)`` is stored."""
    kernel, pages = kernels.load("page_attention"), pages.contiguous()
    return attend_by_parts(
        query, scaling, key.shape[1],
        lambda q: kernel.page_logits(q.contiguous(), key, pages, block, total),  # (B, H_kv, g, n)
        lambda p: kernel.page_values(p.contiguous(), value, pages, block, total),  # (B, H_kv, g, D)
    )  # fmt: skip
