"""Formulas of score-based eviction (H2O, SnapKV, TOVA; PyramidKV resolves to these per layer).

Which tokens survive depends on attention scores; how many does not. A layer's target after ``t`` tokens
is ``keep_count(t)``: ``budget``, or ``max(1, int(t * (1 - compression_ratio)))``; it evicts down to it
whenever it holds more, after the step's attention.
"""

from __future__ import annotations

from kvcompress.memory_model.core import Shape, formula
from kvcompress.policies import EvictionPolicy, H2OPolicy, SnapKVPolicy, TOVAPolicy

ACC_BYTES = 4  # H2O's accumulator is float32 whatever the model dtype
POS_BYTES = 4  # and its int32 position of each stored token (the recent window is found by position)


def kept_every_step(p: EvictionPolicy, t: int) -> int:
    """Tokens per head of a layer that enforces its target at every step: ``min(t, keep_count(t))``.

    ``keep_count`` grows by at most one token per token seen, so a decode step never leaves more.
    """
    return min(t, p.keep_count(t))


@formula(TOVAPolicy)
def _tova(p: TOVAPolicy, s: Shape) -> int:
    """TOVA evicts at every step: ``kv(min(T, keep_count(T)))``."""
    return s.kv(kept_every_step(p, s.total))


@formula(H2OPolicy)
def _h2o(p: H2OPolicy, s: Shape) -> int:
    """H2O evicts at every step and keeps one float32 accumulated score and one int32 position per kept
    token and KV head: ``kv(k) + 8 * B * H_kv * k`` with ``k = min(T, keep_count(T))`` (``recent`` splits
    k, not adds)."""
    k = kept_every_step(p, s.total)
    return s.kv(k) + (ACC_BYTES + POS_BYTES) * s.batch * s.kv_heads * k


@formula(SnapKVPolicy)
def _snapkv(p: SnapKVPolicy, s: Shape) -> int:
    """SnapKV compresses the prompt to ``k = min(n, keep_count(n))``. With ``slack`` null decode tokens are
    appended (``k + decode_tokens``); with ``slack`` set a decode step that leaves more than
    ``keep_count(t) + slack`` compresses back to ``keep_count(t)``, and the layer holds the last
    ``min(window, T)`` queries (B, H, w, D) in the model dtype for that."""
    stored = min(s.prefill, p.keep_count(s.prefill))
    for t in range(s.prefill + 1, s.total + 1):
        stored += 1
        if p.slack is not None and stored > p.keep_count(t) + p.slack:
            stored = p.keep_count(t)
    queries = 0
    if p.slack is not None:
        queries = s.batch * s.heads * min(p.window, s.total) * s.head_dim * s.dtype_bytes
    return s.kv(stored) + queries
