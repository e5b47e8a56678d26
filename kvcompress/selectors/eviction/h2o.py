"""H2O: heavy hitters (accumulated attention) plus a recent window, enforced at every step.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv 2306.14048.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.fields import Int
from kvcompress.core.policy import Shape
from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy
from kvcompress.selectors.eviction.when import EVICT_AT

ACC_BYTES = POS_BYTES = 4  # float32 accumulated score and int32 position per kept token and KV head


class H2OLayer(EvictionLayer):
    """Holds the accumulated scores ``acc`` (B, H_kv, T) float32 and each stored token's position ``pos``
    (B, H_kv, T) int32 next to the keys they rank. The recent window is found by position, not by stored
    order, so a decode step's single eviction moves the newest token into the hole (O(1), ``drop_one``)."""

    order_free = True
    reads_as_stored = True  # scored by the decode query over every stored token: over quant, from the codes
    needs_positions = True  # the base layer's ``pos`` (B, 1 or H_kv, T) int32
    per_token = ("acc",)

    def on_append(self, key_states, new_valid) -> None:
        super().on_append(key_states, new_valid)
        b, h, q, _ = key_states.shape
        if self.acc is None:
            self.acc = torch.zeros(b, h, q, dtype=torch.float32, device=key_states.device)
        else:  # the new tokens' entries start at 0, written in place when the buffer has room
            self.acc = self.slots.grow("acc", self.acc, 0.0, q=q)

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        self.acc += self.scores(query, key, scaling, self.policy.observation_window, probs).sum(dim=2)
        k, t = self.target(), self.stored_length()
        if self.due() if self.flat else t > k:  # (``due`` once flat: a threshold's own schedule)
            recent = self.policy.recent_for(k)
            protected = self.pos >= self.seen - recent  # the `recent` newest positions, wherever stored
            one = t - k == 1 and recent < t and not self.flat
            if not (one and self._drop_lowest(protected)):  # refused: ``select`` need not try it again
                self.select(self.acc, k, pinned=protected, refill=not one)

    def _drop_lowest(self, protected: torch.Tensor) -> bool:
        """A decode step's one eviction: the unprotected token of lowest score leaves, in place. ``select``'s
        choice (ties: the first stored) in float32 without its float64 priorities: positions are distinct,
        so with ``recent < T`` some token is unprotected. False, doing nothing, where ``select`` must decide
        (padding stored, chunk units or spans, storage that cannot move a token now)."""
        if self.valid is not None or not self.order_free or not self.store.can_evict_one():
            return False
        return self.drop_one(self.acc.masked_fill(protected, torch.inf).argmin(dim=-1, keepdim=True))

    def token_order(self, t: int, device) -> torch.Tensor:
        return self.pos.double()  # stored order is not sequence order after an in-place eviction


@dataclass
class H2OPolicy(EvictionPolicy):
    """Keep the tokens with the largest accumulated attention plus the ``recent`` newest ones.

    Each stored token accumulates the attention it receives (averaged over the query heads of its KV
    group): from every decode query, and at prefill from the last ``observation_window`` prompt queries.
    The paper accumulates over all prompt queries; that is a T x T matrix, so we use the last ones.

    Args:
        budget / compression_ratio: see ``EvictionPolicy``.
        recent: newest tokens always kept; None gives half of the kept tokens, the paper's equal split.
        observation_window: prompt queries whose attention seeds the accumulator at prefill.
        evict_at: always (the paper's: the heavy hitters are re-chosen at every generated token); prefill:
            the prompt is cut once and decode tokens are appended (unscored).
    """

    layer_class = H2OLayer
    adaptive_decode = True  # scored by the decode query alone: pairs can compete across heads at each step
    FORMULA = True  # the memory formulas below are this class's own
    MAX_MEMORY_RATIO = 1.07  # float32 score + int32 position per token and head: 6.25% of K+V at D=16
    TEST_PARAMS = {"budget": 12, "compression_ratio": None, "recent": 4, "observation_window": 6}
    FUZZ = [
        {**alt, "recent": [None, 0, 3, 10], "observation_window": (1, 8), "evict_at": list(EVICT_AT)}
        for alt in EvictionPolicy.FUZZ
    ]
    MEMORY_VARIANTS = [
        {"budget": None, "compression_ratio": 0.5},
        {"budget": None, "compression_ratio": 0.3, "recent": 8},
    ]

    recent: int | None = Int(None, low=0, null=True)
    observation_window: int = Int(32, low=1)

    def __post_init__(self):
        super().__post_init__()
        if self.budget is not None and self.recent is not None and self.recent > self.budget:
            raise ValueError(
                f"h2o.budget={self.budget} is below recent={self.recent}: the recent window is always "
                "kept, so budget must be >= recent"
            )

    def recent_for(self, k: int) -> int:
        """The newest tokens kept: ``recent``, or half of ``k`` (0 with a threshold, which sets no count)."""
        if self.recent is not None:
            return self.recent
        return 0 if self.threshold is not None else k // 2

    def state_bytes(self, s: Shape, kept: int) -> int:
        """One float32 accumulated score per kept token and KV head, and one int32 position per kept token,
        per KV head once heads have evicted differently (shared by the heads of a row until then)."""
        pos_heads = s.kv_heads if kept < s.total else 1
        return s.per_token(ACC_BYTES, kept) + s.batch * pos_heads * kept * POS_BYTES
