"""The model's own window on its windowed layers: what transformers' ``DynamicSlidingWindowLayer`` keeps.

A sliding-window (or chunked) layer never attends further back than ``window - 1`` tokens, so it keeps only
those after each step, in the model's dtype; its bytes are counted like any other layer's. Policies with
``apply_to: full_attention`` (the default) leave windowed layers to this layer and compress only the global
ones; ``apply_to: all`` runs the policy there too, inside the model's window.
"""

from __future__ import annotations

from kvcompress.core.layer import PolicyLayer


class ModelWindowLayer(PolicyLayer):
    """Keeps the last ``window - 1`` stored tokens (the same slots in every row, padding included, as
    transformers does); the step that brings them in still reads them all, masked by the window."""

    contiguous = True
    reads_as_stored = False  # its step selects what is read (``compress``/``attend``)

    def compress(self, keys, values) -> None:
        keep, total = max(self.window - 1, 0), self.stored_length()
        if total > keep:
            self.keep_spans([(total - keep, total)])

    def stats(self) -> dict:
        """What the model's own window dropped is the model's semantics, not compression: it is reported as
        ``model_window_dropped`` and kept out of ``tokens_evicted`` (so ``full`` on Gemma is not flagged as
        compressed)."""
        base = super().stats()
        dropped = base.pop("tokens_evicted")
        return {
            **base,
            "tokens_evicted": 0,
            "model_window_dropped": dropped,
            "selector": "model_window",
            "model_window": self.window,
        }
