"""A selector that only ranks tokens: one ``score(step)`` method (the shape of kvpress's ``ScorerPress``).

A ``ScorerPolicy`` subclass writes ``score(step)``: priorities (B, 1 or H_kv, T) of the stored tokens, higher
kept, from a ``Step`` record. ``ScorerLayer`` does the rest once for all of them: when to evict
(``evict_at``; budget, ratio or ``threshold``), the ``protect`` newest tokens kept first, padding never kept
over real tokens, the per-head top-k that frees the evicted tokens' storage (``EvictionLayer.select``), and
what attention hands over (``asks``: the stored keys alone, or the last queries' probabilities too). A
scorer reads the step and never the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcompress.core.fields import Choice
from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy
from kvcompress.selectors.eviction.when import EVICT_AT

ASKS = ("keys", "attention")


@dataclass(frozen=True)
class Step:
    """What one evicting step shows a scorer; its tensors are the layer's, read and never kept.

    ``query`` (B, H, q, D): the step's queries; ``keys`` (B, H_kv, T, D): the stored keys as this step's
    attention read them (dequantized where the storage packs them); ``valid`` (B, 1 or H_kv, T): False on
    padding slots, None where no padding is stored; ``seen``: tokens consumed so far; ``scaling``: the
    attention's softmax scale."""

    query: torch.Tensor
    keys: torch.Tensor
    valid: torch.Tensor | None
    seen: int
    scaling: float
    layer: ScorerLayer
    probs: torch.Tensor | None = None

    @property
    def values(self) -> torch.Tensor:
        """(B, H_kv, T, D) the stored values (read from the store on demand: over quantized storage, a
        dequantized copy)."""
        return self.layer.stored_values()

    @property
    def layer_idx(self) -> int:
        return self.layer.layer_idx

    def first_real(self, n: int) -> torch.Tensor:
        """(B or 1, 1 or H_kv, T) bool: each row's first ``n`` real stored tokens (attention sinks)."""
        return self.layer.first_real(n, self.keys.shape[-2], self.keys.device)

    def attention(self, window: int = 1) -> torch.Tensor:
        """(B, H_kv, w, T) float32 attention of the last ``window`` queries, averaged over each KV group's
        query heads (the decode query's own probabilities where the backend computed them)."""
        return self.layer.scores(self.query, self.keys, self.scaling, window, self.probs)


class ScorerLayer(EvictionLayer):
    """Scores the stored tokens with its policy's ``score`` after a step's attention, and keeps the best."""

    def __init__(self, policy, layer_idx, spec, store):
        super().__init__(policy, layer_idx, spec, store)
        self.observed_probs = "last" if policy.asks == "attention" else "none"
        # scored from the decode query's probabilities alone, which a backend computes from the codes too
        self.reads_as_stored = self.reads_as_stored or policy.asks == "attention"
        self.order_free = self.order_free and policy.protect == 0  # a protected tail is found by order

    order_free = True

    def never_crops(self) -> str | None:
        """A scorer of the stored keys alone crops exactly wherever no eviction happened among the tokens a
        crop removes (``core.rollback`` checks that); one that reads queries decides from every query's
        attention when it evicts at decode steps (``EvictionLayer.never_crops``)."""
        return None if self.policy.asks == "keys" else super().never_crops()

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        k = self.target()
        if not (self.due() if self.flat else self.stored_length() > k):
            return
        step = Step(query, key, self.valid, self.seen, scaling, self, probs)
        scores, pinned = self.policy.score(step), self.policy.pinned(step)
        self.select(scores, k, protect=min(self.policy.protect, k), pinned=pinned)

    def stored_values(self) -> torch.Tensor:
        return self.store.read()[1]


@dataclass
class ScorerPolicy(EvictionPolicy):
    """An eviction policy whose selector is its ``score(step)`` (module docstring). ``asks``: ``keys`` (the
    stored keys alone) or ``attention`` (``step.attention`` reuses the decode query's probabilities);
    ``protect``: the newest tokens kept whatever their score."""

    layer_class = ScorerLayer
    asks: ClassVar[str] = "keys"
    FORMULA = True  # no per-token state: the inherited kept_tokens() / state_bytes() describe it exactly
    FORMULA_HERITABLE = True  # and every scorer's, which holds no state of its own (``declares_formula``)
    TEST_PARAMS = {"budget": 12, "compression_ratio": None}  # makes a 48-token test compress
    FUZZ = [{**alt, "evict_at": list(EVICT_AT)} for alt in EvictionPolicy.FUZZ]  # both: a scorer serves both

    evict_at: str = Choice("prefill", EVICT_AT)  # kvpress's ScorerPress: the prompt once

    def __post_init__(self):
        if self.asks not in ASKS:
            raise ValueError(f"{type(self).__name__}.asks={self.asks!r}; allowed: {list(ASKS)}")
        super().__post_init__()

    @property
    def protect(self) -> int:
        """Newest tokens kept first at every eviction (0: none, as kvpress's scorers)."""
        return 0

    def pinned(self, step: Step) -> torch.Tensor | None:
        """(B or 1, 1 or H_kv, T) bool: tokens kept first whatever their score (sinks), or None."""
        return None

    def score(self, step: Step) -> torch.Tensor:
        """(B, 1 or H_kv, T) priority of each stored token, higher kept."""
        raise NotImplementedError(f"{type(self).__name__} must define score(step)")
