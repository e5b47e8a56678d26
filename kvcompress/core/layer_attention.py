"""The attention side of a policy layer: its step as a ``Plan``, and what it does with attention's result.

``plan`` turns what ``update`` stored into the read attention must make: dense keys/values masked from
the layer's own state (``attend``), or, for a step ``update`` deferred, the store's compact form (packed
codes, latents) or Quest's pages in place, with the dense read to fall back on. ``attended`` hands the
probe what was read, the selector its scores, and counts the backend that ran (``stats``).
"""

from __future__ import annotations

import torch

from kvcompress.core.plan import Dense, Plan


class LayerAttention:
    """Mixed into ``PolicyLayer``; ``attend``, ``read_deferred``, ``observes`` and ``end_step`` are its."""

    grouped_decode = False  # a decode query attends in the grouped form of the eviction layers
    observed_probs = "last"  # what ``observe_attention`` gets back from the backend (``plan.PROBS``)

    def plan(self, query, key, value) -> Plan:
        """This step's plan for query (B, H, q, D) over what ``update`` returned (B, H_kv, T, D): the store's
        compact read for a step ``update`` deferred, else the dense read masked from the layer's state."""
        key, value, mask = self.attend(query, key, value)
        if self.deferred:
            return Plan(self.compact_read())
        probs = self.observed_probs if self.wants_scores and self.observes() else "none"
        if mask is not None:
            mask = expand_heads(mask, query.shape[1])
        return Plan(Dense(key, value, mask), probs, self.grouped_decode)

    def compact_read(self):
        """The deferred step's compact read (``kvcompress.core.plan``): the store's own."""
        return self.store.compact_read()

    def dense_plan(self, plan: Plan) -> Plan:
        """The deferred step of ``plan`` as a dense read, where no backend reads its compact form."""
        key, value = self.read_deferred()
        return Plan(Dense(key, value, None), plan.probs, plan.grouped)

    def compact_done(self) -> None:
        """After a compact read ran: the step ends (the store compresses what waited)."""
        self.deferred = False
        self.end_step()

    def attended(self, plan: Plan, call, out, probs, backend: str) -> None:
        """After attention: count what ran (``backend``, the read's form), end a compact step, show the probe
        what was read, give the selector its scores (``probs``: the decode query's, when the backend computed
        them) and end the step."""
        read = plan.read
        if not self.in_context_pass:  # a context pass's reconstruction is not one of the model's steps
            self.backends_ran[backend] = self.backends_ran.get(backend, 0) + 1
            self.reads_ran[read.form] = self.reads_ran.get(read.form, 0) + 1
        if read.form != "dense":
            self.compact_done()
            return
        if self.probe is not None:  # fidelity diagnostics, before any eviction
            self.probe.attended(self, call.query, read.key, read.value, read.mask, call.scaling, out)
        if plan.probs != "none":
            self.observe_attention(call.query, read.key, call.scaling, probs)
            self.end_step()


def expand_heads(mask: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Per-KV-head masks (B, H_kv, q, T) become (B, H, q, T); shared masks stay (B, 1, q, T)."""
    if mask is None or mask.shape[1] in (1, num_heads):
        return mask
    return mask.repeat_interleave(num_heads // mask.shape[1], dim=1)
