"""KVzap: KVzip's query-agnostic scores predicted from each pair's own key and value, inside the prefill.

Jegou et al., "KVzap" (arXiv 2601.07891) and Fast KVzip (arXiv 2601.17668): a model trained to predict KVzip's
reconstruction scores (Kim et al., arXiv 2505.23416) replaces the context pass, so compression costs one
small map per layer instead of a second pass over the context. Here the map is linear per layer and KV head,
over the key's RoPE-pair magnitudes and the value (``kvzap_fit``, fitted on the model from a text's tail
and saved beside the low-rank calibrations the first time a model is used, then loaded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcompress.core.fields import Int
from kvcompress.core.policy import Shape
from kvcompress.selectors.eviction import kvzap_fit
from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy

_SMALL_FIT = {"fit_text": "random", "fit_documents": 3, "fit_tokens": 24, "fit_holdout": 1}  # tests: seconds


class KVzapLayer(EvictionLayer):
    """At a multi-token step that leaves more than the target, keeps the last ``window`` tokens, the first
    ``sink_tokens`` real ones, and each KV head's pairs of highest predicted score. Decode tokens are
    appended."""

    observed_probs = "none"  # scores from the stored keys and values: the model's own kernel attends

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        k = self.target()
        if query.shape[2] == 1 or self.stored_length() <= k:
            return
        scores = kvzap_fit.predict(self.policy.weights[self.layer_idx], key, self.store.read()[1])
        sinks = self.first_real(self.policy.sink_tokens, scores.shape[-1], scores.device)
        if self.valid is not None:
            scores.masked_fill_(~self.valid, -math.inf)
        self.select(scores, k, protect=min(self.policy.window, k), pinned=sinks)


@dataclass
class KVzapPolicy(EvictionPolicy):
    """Keep, per layer and KV head, the ``budget`` (or ``1 - compression_ratio``) prompt pairs: the last
    ``window``, the first ``sink_tokens``, and those whose predicted KVzip score is highest; no context pass.

    Args:
        budget / compression_ratio: see ``EvictionPolicy`` (of the tokens held at each prefill step).
        sink_tokens: first real tokens always kept.
        window: last tokens always kept (within the budget), as KVzap's sliding window: a map of a pair's
            own key and value cannot see that the prompt's last tokens (a question, the reply's turn) are
            what the next queries read. On the embedded model kvzap answered 1 of 90 RULER samples at 0.75
            with or without it (docs/results.md).
        fit_text: the text whose last ``fit_documents * fit_tokens`` tokens the scorer is fitted on
            (``pg_essays``, a path, a `datasets` spec, or ``random`` for tests).
        fit_documents: pieces of ``fit_tokens`` tokens; the last ``fit_holdout`` are held out and scored.
        fit_dir: where fitted scorers are saved (null: ``<kvcompress cache>/calibration``).
    """

    layer_class = KVzapLayer
    evicts = "prefill"
    FORMULA = True  # the memory formula below is this class's own
    TEST_PARAMS = {"budget": 12, "compression_ratio": None, "sink_tokens": 2, "window": 3, **_SMALL_FIT}
    FUZZ = [{**alt, "sink_tokens": (0, 6), "window": (0, 8), **_SMALL_FIT} for alt in EvictionPolicy.FUZZ]

    sink_tokens: int = Int(4, low=0)
    window: int = Int(32, low=0)
    fit_text: str = "pg_essays"
    fit_documents: int = Int(24, low=2)
    fit_tokens: int = Int(512, low=8)
    fit_holdout: int = Int(6, low=1)
    fit_dir: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.fit_holdout >= self.fit_documents:
            raise ValueError(
                f"kvzap.fit_holdout={self.fit_holdout} must be below "
                f"kvzap.fit_documents={self.fit_documents}: the scorer needs documents to fit on"
            )

    def prepare(self, model) -> None:
        """Load this model's fitted scorer, fitting it first when none is saved (``kvzap_fit.scorer``)."""
        super().prepare(model)
        found = kvzap_fit.scorer(model, self.fit_text, self.fit_documents, self.fit_tokens, self.fit_holdout,
                                 self.fit_dir)  # fmt: skip
        self.weights = found["weights"]  # (L, H_kv, F) float32, not a field: what the fit found

    def kept_tokens(self, s: Shape) -> int:
        """The prompt cut to ``min(n, keep_count(n))`` at the prefill; decode tokens appended."""
        return min(s.prefill, self.keep_count(s.prefill)) + s.decode
