"""The attention side of a policy layer: its step as a ``Plan``, and what it does with attention's result.

``plan`` turns what ``update`` stored into the read attention must make: dense keys/values masked from
the layer's own state (``attend``), or, for a step ``update`` deferred, the store's compact form (packed
codes, latents) or Quest's pages in place, with the dense read to fall back on. ``attended`` hands the
probe what was read, the selector its scores, and counts the backend that ran (``stats``).
"""

from __future__ import annotations

import torch

from kvcompress.core.plan import Dense, Plan
from kvcompress.core.profiling import TIMER


class LayerAttention:
    """Mixed into ``PolicyLayer``; ``attend``, ``read_deferred``, ``observes`` and ``end_step`` are its."""

    grouped_decode = False  # a decode query attends in the grouped form of the eviction layers
    observed_probs = "last"  # what ``observe_attention`` gets back from the backend (``plan.PROBS``)

    def plan(self, query, key, value) -> Plan:
        """This step's plan for query (B, H, q, D) over what ``update`` returned (B, H_kv, T, D)."""
        key, value, mask = self.attend(query, key, value)
        if self.deferred:
            read = self.compact_read()
            dense = None if read.required else self._dense_read
            return Plan(read, dense=dense, done=self.compact_done)
        probs = self.observed_probs if self.observes() else "none"
        return Plan(Dense(key, value, expand_heads(mask, query.shape[1])), probs, self.grouped_decode)

    def compact_read(self):
        """The deferred step's compact read (``kvcompress.core.plan``): the store's own."""
        return self.store.compact_read()

    def compact_done(self) -> None:
        """After a compact read ran: the step ends (the store compresses what waited)."""
        self.deferred = False
        with TIMER.measure():
            self.end_step()

    def _dense_read(self) -> Dense:
        with TIMER.measure():
            key, value = self.read_deferred()
        return Dense(key, value, None)

    def attended(self, plan: Plan, call, out, probs, ran: tuple[str, str]) -> None:
        """After attention: count what ran (backend, read form), show the probe what was read, give the
        selector its scores (``probs``: the decode query's, when the backend computed them), end the step."""
        if not self.in_context_pass:  # a context pass's reconstruction is not one of the model's steps
            self.backends_ran[ran[0]] = self.backends_ran.get(ran[0], 0) + 1
            self.reads_ran[ran[1]] = self.reads_ran.get(ran[1], 0) + 1
        read = plan.read
        if self.probe is not None and plan.form == "dense":  # fidelity diagnostics, before any eviction
            self.probe.attended(self, call.query, read.key, read.value, read.mask, call.scaling, out)
        if plan.probs != "none":
            with TIMER.measure():
                self.observe_attention(call.query, read.key, call.scaling, probs)
                self.end_step()


def expand_heads(mask: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Per-KV-head masks (B, H_kv, q, T) become (B, H, q, T); shared masks stay (B, 1, q, T)."""
    if mask is None or mask.shape[1] in (1, num_heads):
        return mask
    return mask.repeat_interleave(num_heads // mask.shape[1], dim=1)
