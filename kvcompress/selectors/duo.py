"""DuoAttention: retrieval heads keep every token, streaming heads only attention sinks and a recent window.

Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", arXiv
2410.10819. Which KV heads retrieve is decided once per model by a calibration (``duo_fit``: the paper's
gate optimisation, or a cheaper attention-mass criterion whose agreement with it the fit reports), saved
beside the low-rank calibrations and loaded by key. The two kinds of heads live in two stores of the
policy's storage (``storage.heads``), so a streaming head's older tokens are really freed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.core import attention
from kvcompress.core.fields import Choice, Float, Int
from kvcompress.core.layer import PolicyLayer
from kvcompress.core.masks import cat_valid
from kvcompress.core.policy import Policy, Shape
from kvcompress.selectors import duo_fit
from kvcompress.storage.heads import HeadSplitStore

SPLITS = ("dense", "quant", "turboquant")  # storages whose store of a head subset holds no per-head state
_SMALL_FIT = {"fit_text": "random", "fit_documents": 2, "fit_tokens": 24, "fit_steps": 2}  # tests: seconds


class DuoLayer(PolicyLayer):
    """Both parts store every step's tokens; at the end of each step the streaming heads keep their first
    ``sink_tokens`` and last ``window`` stored tokens. A decode step reads each part where it lies; a step of
    several tokens (or one over padded rows) after the parts differ reads them padded to the longer part,
    each head masked to its own tokens. The layer's ``valid`` follows the longer part, ``stream_valid`` the
    streaming part once they differ."""

    pads_exactly = False  # sinks and window are cut by stored order: a left-padded row's sinks are padding
    per_row = ("stream_valid",)  # (B, 1, T_s) bool, or None: moved by beam reorders

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_lengths: list[int] = []  # tokens each KV head's attention reads this step
        self.read_valid: torch.Tensor | None = None  # ``stream_valid`` as the step's attention reads it

    def step(self, key_states, value_states, positions=None, forward=None):
        b, _, q, _ = key_states.shape
        self.read_lengths = [n + q for n in self._lengths()]  # what this step's attention reads, per KV head
        if not self.store.same_lengths():  # the streaming part's own validity grows with it
            new_valid = attention.validity(forward, b, q, key_states.device)
            if new_valid is not None or self.stream_valid is not None:
                n = self.store.streaming.length
                self.stream_valid = cat_valid(self.stream_valid, new_valid, n, b, q, key_states.device)
        self.read_valid = self.stream_valid  # as this step's attention reads it (an eviction may come first)
        return super().step(key_states, value_states, positions, forward)

    def attend(self, query, key, value):
        """Every head reads its own part's tokens (as stored before the step's eviction, which may come
        first); causal among the step's queries; never padding."""
        lengths, read_valid = self.read_lengths, self.read_valid
        self.read_valid = None  # step-local: no uncounted copy of the validity outlives the step
        if len(set(lengths)) == 1:
            return super().attend(query, key, value)
        self._view = (key.shape[-2], None, None)
        self.count_read(sum(lengths) / len(lengths))  # the heads' mean
        if self.deferred:  # each part is read where it lies (``HeadSplitStore.compact_read``)
            return key, value, None
        q, t, device = query.shape[2], key.shape[-2], key.device
        last = torch.tensor(lengths, device=device).view(1, -1, 1, 1) - q
        last = last + torch.arange(q, device=device).view(1, 1, q, 1)
        mask = torch.arange(t, device=device).view(1, 1, 1, t) <= last  # (1, H_kv, q, T)
        if self.valid is None:
            return key, value, mask
        valid = torch.ones(key.shape[0], key.shape[1], t, dtype=torch.bool, device=device)
        for heads, part in zip(self.store.heads, (self.valid, read_valid), strict=True):
            if heads and part is not None:  # both parts exist here: the lengths differ
                valid[:, list(heads), : part.shape[-1]] = part[:, :1]
        mask = mask & valid[:, :, None, :]
        return key, value, mask | ~mask.any(-1, keepdim=True)  # padding queries: no all-masked row

    def _lengths(self) -> list[int]:
        """Tokens held by each KV head."""
        lengths = [0] * self.spec.num_kv_heads
        for heads, n in self.store.lengths():
            for h in heads:
                lengths[h] = n
        return lengths

    def end_step(self) -> None:
        self._trim()
        super().end_step()

    def _trim(self) -> None:
        """The streaming heads keep their first ``sink_tokens`` and last ``window`` stored tokens."""
        store, sinks, window = self.store, self.policy.sink_tokens, self.policy.window
        n = 0 if store.streaming is None else store.streaming.length
        if n <= sinks + window:
            return
        spans = [(0, sinks), (n - window, n)]
        if store.retrieval is None:  # one part: the layer's own per-token state follows it
            self.keep_spans(spans)
            return
        valid = self.valid if store.same_lengths() else self.stream_valid
        store.streaming.keep_spans(spans)
        self.stream_valid = None if valid is None else torch.cat([valid[..., a:b] for a, b in spans], dim=-1)
        self.evicted += n - sinks - window


@dataclass
class DuoPolicy(Policy):
    """Keep every token in the ``retrieval_ratio`` of KV heads that the calibration ranks highest (over the
    whole model, as the paper's one threshold), and ``sink_tokens + window`` tokens in the others.

    Args:
        retrieval_ratio: share of the model's KV heads that keep every token (rounded to whole heads).
        sink_tokens: first tokens a streaming head keeps.
        window: newest tokens a streaming head keeps (a decode step's own token is read before it leaves).
        criterion: how heads are ranked: ``gates`` (the paper's optimisation of one gate per KV head mixing
            full and streaming attention, distilling the last hidden states) or ``mass`` (the attention a
            head gives beyond its sinks and window); the fit reports how the two agree.
        fit_text: text whose last ``fit_documents * fit_tokens`` tokens the calibration reads (``pg_essays``,
            a path, a `datasets` spec, or ``random`` for tests).
        fit_documents / fit_tokens: calibration pieces; each is followed by a repeat of an early span so that
            its last tokens need retrieval.
        fit_steps: optimiser steps of the gates.
        fit_dir: where classifications are saved (null: ``<kvcompress cache>/calibration``).
    """

    layer_class = DuoLayer
    evicts = "always"
    FORMULA = True  # the memory formula below is this class's own
    TEST_PARAMS = {"retrieval_ratio": 0.5, "sink_tokens": 2, "window": 8, **_SMALL_FIT}
    FUZZ = {"retrieval_ratio": [0.0, 0.25, 0.5, 1.0], "sink_tokens": (0, 4), "window": (1, 16),
            "criterion": ["gates", "mass"], **_SMALL_FIT}  # fmt: skip
    MEMORY_VARIANTS = [{"retrieval_ratio": 0.25, "window": 20}]

    retrieval_ratio: float = Float(0.5, low=0.0, high=1.0)
    sink_tokens: int = Int(4, low=0)
    window: int = Int(60, low=1)
    criterion: str = Choice("gates", duo_fit.CRITERIA)
    fit_text: str = "pg_essays"
    fit_documents: int = Int(8, low=2)
    fit_tokens: int = Int(512, low=16)
    fit_steps: int = Int(60, low=1)
    fit_dir: str | None = None

    def covering(self, n_tokens: int) -> DuoPolicy:
        """A streaming head's window covers ``n_tokens``: every head keeps every token, as ``full``."""
        return dataclasses.replace(super().covering(n_tokens), window=max(self.window, n_tokens))

    def refuses_storage(self, storage) -> str | None:
        if storage.name not in SPLITS and not storage.refuses(self):  # a storage's own refusal comes first
            return (
                f"duo holds each layer's retrieval and streaming heads in two stores of its storage, and "
                f"storage={storage.name} keeps per-head state a subset of heads would misread: use one of "
                f"{list(SPLITS)}"
            )
        return None

    def prepare(self, model) -> None:
        """Rank this model's KV heads (``duo_fit.ranking``, fitted the first time, then loaded)."""
        super().prepare(model)
        found = duo_fit.ranking(model, self.fit_text, self.fit_documents, self.fit_tokens, self.fit_steps,
                                self.sink_tokens, self.window, self.fit_dir)  # fmt: skip
        self.scores = found[self.criterion]  # (L, H_kv) float32, not a field: what the fit found
        self.retrieval = duo_fit.top_heads(self.scores, self.retrieval_ratio)  # (L, H_kv) bool

    def layer(self, layer_idx: int, spec) -> PolicyLayer:
        if spec.window(layer_idx) is not None:
            if self.apply_to == "full_attention":
                return super().layer(layer_idx, spec)  # the model's own window
            raise ValueError(
                "duo.apply_to=all: duo serves full-attention layers; use apply_to=full_attention"
            )
        retrieval = self.heads_of(layer_idx)
        heads = (tuple(h for h in range(spec.num_kv_heads) if retrieval[h]),
                 tuple(h for h in range(spec.num_kv_heads) if not retrieval[h]))  # fmt: skip
        return DuoLayer(self, layer_idx, spec, HeadSplitStore(self.storage, layer_idx, spec, heads))

    def heads_of(self, layer_idx: int) -> list[bool]:
        """Which KV heads of layer ``layer_idx`` retrieve (``prepare`` ranked them)."""
        if getattr(self, "retrieval", None) is None:
            raise RuntimeError(
                "duo: its heads are ranked by prepare(model), which build_cache calls; call it first"
            )
        return [bool(x) for x in self.retrieval[layer_idx]]

    # -- memory formula ---------------------------------------------------------------------
    def kept_tokens(self, s: Shape) -> int:
        """A retrieval head's tokens (every one); ``layer_parts`` gives the streaming heads'."""
        return s.total

    def layer_parts(self, s: Shape, layer_idx: int) -> list[tuple[Shape, int]] | None:
        """Retrieval heads keep every token, streaming heads ``min(T, sink_tokens + window)``, each part in
        its own store; None before ``prepare`` ranked the heads."""
        if getattr(self, "retrieval", None) is None:
            return None
        group = s.heads // s.kv_heads
        n_r = sum(self.heads_of(layer_idx))
        counts = [(n_r, s.total), (s.kv_heads - n_r, min(s.total, self.sink_tokens + self.window))]
        return [(s._replace(kv_heads=h, heads=h * group), t) for h, t in counts if h]
