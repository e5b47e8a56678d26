"""The reconstruction mode every cache layer has during a context pass (``kvcompress.runtime.context_pass``).

While KVzip's layers score the model's reconstruction of the context (Kim et al., arXiv 2505.23416), every
other layer of the model sees the same forwards: a windowed layer left to the model's own window on
Gemma-3, a ``full`` layer in a schedule. In this mode a layer stores nothing: ``update`` returns what it
holds followed by the step's own keys and values, masked as the model would (causal, within its window), and
no selector acts on the step (no ``compress``, no scores). ``end_context_pass`` leaves it as it was.
"""

from __future__ import annotations

import torch

from kvcompress.core import attention
from kvcompress.core.masks import cat_valid


class ContextPassMode:
    """Mixin of ``PolicyLayer``: ``begin_context_pass`` / ``pass_update`` / ``end_context_pass``."""

    needs_context_pass = False  # True: the layer scores the pass and evicts at its end (KVzip)

    def begin_context_pass(self) -> None:
        if not self.is_initialized:
            raise RuntimeError("compress_context needs a prefilled cache (no tokens stored yet)")
        if self.window is not None and self.track:
            raise ValueError(
                f"layer {self.layer_idx}: a windowed layer whose selector evicts (apply_to=all) cannot "
                "take part in a context pass (its window over evicted tokens is not masked there); use "
                "apply_to=full_attention"
            )
        self.in_context_pass = True

    def end_context_pass(self, evict: bool = True, keep: int | None = None) -> None:
        """Back to normal steps; a layer that does not score the pass has nothing to evict."""
        self.in_context_pass, self.pass_valid = False, None

    def observes(self) -> bool:
        """Whether this step's attention probabilities go back to the layer (``observe_attention``): never
        during a pass it does not score."""
        return self.wants_scores and (self.needs_context_pass or not self.in_context_pass)

    def pass_update(self, key_states: torch.Tensor, value_states: torch.Tensor, forward):
        """A reconstruction step (B, H_kv, q, D): what the layer holds then the step's own tokens, stored
        nothing; ``pass_valid`` keeps the keys' validity (B, h, T + q) and the queries' (B, q) or None."""
        keys, values = self.store.read()  # (B, H_kv, T, D): what the context left, nothing appended
        b, _, q, _ = key_states.shape
        queries = attention.validity(forward, b, q, key_states.device)
        valid = cat_valid(self.valid, queries, keys.shape[-2], b, q, key_states.device)
        self._view = (keys.shape[-2] + q, valid, None)  # causal among the pass tokens, after the context
        self.pass_valid = (valid, queries)
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
