"""KVzap: KVzip+'s scores predicted from each layer's input hidden states, in prefill and in decoding.

Jegou et al., "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning" (arXiv 2601.07891), as kvpress's
``KVzapPress`` inside its ``DMSPress`` (Dynamic Memory Sparsification's inference, arXiv 2506.05345): a
surrogate per layer (``model_type``: linear or a two-layer MLP, ``kvzap_model``) maps the attention's input
hidden state of each new token to a log-score per KV head; the last ``window`` tokens are always kept and the
others compete by score. KVzip's context pass (Kim et al., arXiv 2505.23416) is replaced by the surrogate, so
compression costs one small map per token. The surrogates are trained by the toolkit on the model the first
time it is used (``kvzap_fit``: KVzip+ targets on a text's tail, held-out fit recorded), saved and loaded.
The paper prunes by a score threshold (``threshold=``, a log-score: kvpress's example uses -4), evaluated at
prefill (``evict_at: prefill``, DMSPress's default) or also while decoding (``evict_at: always``; with a
threshold every ``threshold_every`` tokens, ``when``; batch 1); a ratio or a fixed count works as for every
scorer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.fields import Choice, Int
from kvcompress.core.policy import Shape
from kvcompress.selectors.eviction import kvzap_fit, kvzap_model
from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy
from kvcompress.selectors.eviction.when import EVICT_AT

SCORE_BYTES = 4  # one float32 predicted score per stored token and KV head
_SMALL_FIT = {"fit_text": "random", "fit_documents": 3, "fit_tokens": 24, "fit_holdout": 1, "fit_sample": 16}


class KVzapLayer(EvictionLayer):
    """Scores each new token from its hidden state as it is stored (``zscore`` (B, H_kv, T) float32, moved
    with every eviction); after a multi-token step's attention (and after every step with
    ``evicts: always``) keeps the last ``window`` tokens and each KV head's best-scored others."""

    wants_hidden = True
    observed_probs = "none"  # scores from the hidden states: the model's own kernel attends
    per_token = ("zscore",)

    def on_append(self, key_states, new_valid) -> None:
        super().on_append(key_states, new_valid)
        new = self.score(self.hidden)  # (B, H_kv, q)
        self.hidden = None
        if self.flat:  # heads keep their own counts (threshold, adaptive): pair t * H + h
            new = new.transpose(1, 2).reshape(new.shape[0], 1, -1)
        self.zscore = new if self.zscore is None else self.slots.grow("zscore", self.zscore, new)

    def score(self, hidden: torch.Tensor | None) -> torch.Tensor:
        """Predicted log KVzip+ scores (B, H_kv, q) float32 of a step's tokens from their hidden states
        (B, q, hidden), the attention module's input."""
        if hidden is None:
            raise ValueError(
                "kvzap scores tokens from the attention's input hidden states, which reach a layer only "
                "inside a model forward with a cache from build_cache (none came with this step)"
            )
        return kvzap_model.predict(self.policy.surrogate, self.layer_idx, hidden)

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        if not self.due():  # (a decode step reaches here only with evict_at: always)
            return
        k = self.target()
        self.select(self.priority(), k, protect=min(self.policy.window, k))

    def priority(self) -> torch.Tensor:
        """The stored scores (B, H_kv, T) float64, padding at -inf and exact ties going to the newer token:
        equal hidden states (a repeated token at the first layer) score equally, and ``topk`` alone would
        break the tie by storage slot, which left padding shifts. The nudge is below half a float32 step."""
        scores = self.zscore.double()
        order = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.float64) / scores.shape[-1]
        scores = scores + order * scores.abs() * 2.0**-26
        return scores if self.valid is None else scores.masked_fill(~self.valid, -torch.inf)


@dataclass
class KVzapPolicy(EvictionPolicy):
    """Keep, per layer and KV head, the last ``window`` tokens and, within the budget (or
    ``1 - compression_ratio`` of the tokens seen), those whose predicted KVzip+ score is highest.

    Args:
        budget / compression_ratio / threshold: see ``EvictionPolicy``; the threshold is on the predicted
            log-score.
        evict_at: prefill (DMSPress's default: steps of several tokens) or always (decode steps too).
        model_type: the surrogate, ``mlp`` (the paper's default: hidden -> 512 -> GELU -> KV heads) or
            ``linear`` (ridge regression).
        window: last tokens always kept (DMSPress's ``sliding_window_size``).
        fit_text: the text whose last ``fit_documents * fit_tokens`` tokens the surrogates are trained on
            (``pg_essays``, a path, a `datasets` spec, or ``random`` for tests).
        fit_documents: pieces of ``fit_tokens`` tokens; the last ``fit_holdout`` are held out and scored.
        fit_sample: random tokens of each training piece the surrogates learn from (the script's 500).
        fit_dir: where trained surrogates are saved (null: ``<kvcompress cache>/calibration``).
    """

    layer_class = KVzapLayer
    adaptive_decode = True  # each pair keeps its predicted score: heads' own pairs compete at decode steps
    evict_at: str = Choice("prefill", EVICT_AT)  # DMSPress's default (decoding=False); always: decode too
    FORMULA = True  # the memory formulas below are this class's own
    MAX_MEMORY_RATIO = 1.07  # a float32 score per token and head: 6.25% of K+V at D=16
    TEST_PARAMS = {"budget": 12, "compression_ratio": None, "window": 3, **_SMALL_FIT}
    FUZZ = [
        {**alt, "window": (0, 8), "model_type": ["linear", "mlp"], **_SMALL_FIT}
        for alt in EvictionPolicy.FUZZ
    ]

    model_type: str = Choice("mlp", kvzap_model.MODEL_TYPES)
    window: int = Int(128, low=0)
    fit_text: str = "pg_essays"
    fit_documents: int = Int(40, low=2)
    fit_tokens: int = Int(1000, low=8)
    fit_holdout: int = Int(4, low=1)
    fit_sample: int = Int(500, low=1)
    fit_dir: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.fit_holdout >= self.fit_documents:
            raise ValueError(
                f"kvzap.fit_holdout={self.fit_holdout} must be below "
                f"kvzap.fit_documents={self.fit_documents}: the surrogate needs documents to fit on"
            )

    def prepare(self, model) -> None:
        """Load this model's trained surrogates, training them first when none are saved (``kvzap_fit``)."""
        super().prepare(model)
        found = kvzap_fit.scorer(model, self.fit_text, self.fit_documents, self.fit_tokens, self.fit_holdout,
                                 min(self.fit_sample, self.fit_tokens), self.fit_dir)  # fmt: skip
        device = next(model.parameters()).device  # moved once here, so no decode step copies the weights
        self.surrogate = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in found[self.model_type].items()
        }  # fmt: skip  (not a field: the fit's)
        self.fit = {"path": found["path"], **found["fit"][self.model_type]}

    def state_bytes(self, s: Shape, kept: int) -> int:
        """One float32 predicted score per kept token and KV head."""
        return s.per_token(SCORE_BYTES, kept)
