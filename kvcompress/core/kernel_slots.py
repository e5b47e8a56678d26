"""Kernels that selectors and storage use outside attention, lent to them by ``kvcompress.kernels.backends``.

Selectors and storage never import ``kvcompress.kernels`` (DESIGN: kernels are called by backends only), yet
the model's own SDPA (``executor.Sdpa``, in core) can return each query's log-sum-exp through one, and
a few of their own steps have a kernel that computes the same numbers as their tensor form, only faster:
a prefill's score window (``torch_attention.window_scores``, Triton), Quest's page choice and turning
pre-RoPE keys by their positions (C++). ``kvcompress.kernels.backends.install()`` registers those here by
slot (``kvcompress`` calls it when imported); a caller asks ``first(slot, ...)`` and runs its own tensor
form where it gets None (nothing registered, or no registered kernel serves these inputs).
"""

from __future__ import annotations

# slot -> f(*args) -> result, or None where the kernel does not serve the inputs:
# window_scores: (query, key, scaling, valid) -> probabilities (``torch_attention.window_scores``)
# select_pages: (query (B, H, D), page_min, page_max, sinks, width) -> pages (B, H_kv, width)
# turn_keys: (keys (B, H_kv, n, D), positions (B, h, n), cos, sin) -> turned keys float32
# sdpa_lse: (call, key, value, mask) -> (output (B, q, H, D), log-sum-exp (B, H, q) float32): the model's SDPA
#   with each query's softmax normaliser (``executor.Sdpa`` with ``probs: lse``)
SLOTS = ("window_scores", "select_pages", "turn_keys", "sdpa_lse")
_LENT: dict[str, list] = {slot: [] for slot in SLOTS}


def lent(slot: str) -> list:
    """The kernels registered in ``slot``, tried in order (the list itself)."""
    if slot not in _LENT:
        raise ValueError(f"kernel slot {slot!r} is unknown; known: {list(SLOTS)}")
    return _LENT[slot]


def register(slot: str, kernel) -> None:
    """Lend ``kernel`` to the callers of ``slot`` (once: registering it again changes nothing)."""
    kernels = lent(slot)
    if kernel not in kernels:
        kernels.append(kernel)


def first(slot: str, *args):
    """The first registered kernel's result for ``args``, or None where none serves them."""
    for kernel in _LENT[slot]:
        out = kernel(*args)
        if out is not None:
            return out
    return None
