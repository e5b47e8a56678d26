"""StreamingLLM: attention sinks plus a sliding window of recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcompress.fields import Int
from kvcompress.policies.base import Policy, Shape
from kvcompress.policies.layer import PolicyLayer


class SlidingWindowLayer(PolicyLayer):
    """Evicts after each step so that at most ``sink_tokens + window`` tokens stay stored.

    Past the budget, decode is O(1) per step on dense storage: the window is a ring. The step's attention
    reads every stored token, the one to evict included, so the eviction is settled at the next look at the
    layer (``_settle``): the newest token moves into the evicted one's slot. The evicted token's bytes sit
    in the buffer's counted headroom until then and are never read again. Elsewhere (padding, tracked
    positions, storage that cannot move a token in place) the window is copied with ``keep_spans``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: int | None = None  # slot whose token the newest replaces at the next look
        self._oldest = 0  # ring offset: the window's oldest token is at slot ``sink_tokens + _oldest``

    def compress(self, keys, values) -> None:
        total, budget = self.stored_length(), self.policy.budget
        if total <= budget:
            return
        if self.valid is None and total == budget + 1 and self._ring_ok():
            self._pending = self.policy.sink_tokens + self._oldest
            self._oldest = (self._oldest + 1) % self.policy.window
            self.evicted += 1
            return
        self._unrotate()
        if self.valid is None:  # no padding: sinks are the first tokens, two slices
            self.keep_spans([(0, self.policy.sink_tokens), (total - self.policy.window, total)])
            return
        self.keep(self._priority(total).topk(budget, dim=-1).indices)

    def _ring_ok(self) -> bool:
        return not self.track and self.probe is None and self.store.can_refill()

    def _settle(self) -> None:
        """Carry out the last step's eviction (after that step's attention read the token)."""
        if self._pending is not None:
            slot, self._pending = self._pending, None
            self.store.refill(slot)

    def _unrotate(self) -> None:
        """Put a rotated ring back in stored order (sinks, window oldest first, newer tokens): one copy,
        only when decode by ring is followed by a step the ring does not serve."""
        if not self._oldest:
            return
        sinks, window, total = self.policy.sink_tokens, self.policy.window, self.stored_length()
        at = sinks + self._oldest
        spans = [(0, sinks), (at, sinks + window), (sinks, at), (sinks + window, total)]
        order = torch.cat([torch.arange(a, b, device=self.device) for a, b in spans])
        self._oldest = 0
        self.store.keep(order.view(1, 1, -1))  # stored tokens only (no padding, no positions tracked)

    def update(self, key_states, value_states, *args, **kwargs):
        self._settle()
        return super().update(key_states, value_states, *args, **kwargs)

    def stored_length(self) -> int:
        self._settle()
        return super().stored_length()

    @property
    def keys(self):
        self._settle()
        return self.store.keys

    @property
    def values(self):
        self._settle()
        return self.store.values

    def tensors(self):
        self._settle()
        return super().tensors()

    def reorder_cache(self, beam_idx) -> None:
        self._settle()
        super().reorder_cache(beam_idx)

    def reset(self) -> None:
        super().reset()
        self._pending, self._oldest = None, 0

    def _priority(self, total: int) -> torch.Tensor:
        """Per row (B, 1, T): sinks (first real tokens) > recent window > older real tokens > padding."""
        valid = self.valid[:, :1]  # validity is shared by heads for this policy
        t = torch.arange(total, device=self.device)
        rank = valid.cumsum(-1)
        sink = valid & (rank <= self.policy.sink_tokens)
        recent = t >= total - self.policy.window
        older = t.float() / total  # among the rest prefer newer tokens
        return valid * (1.0 + older) + recent * 2.0 * valid + sink * 4.0


@dataclass
class SlidingWindowPolicy(Policy):
    """Keep the first ``sink_tokens`` real tokens and the last ``window`` tokens; evict the rest."""

    layer_class = SlidingWindowLayer
    FORMULA = True  # the memory formulas below are this class's own
    evicts = "always"
    heads_share_tokens = True  # every KV head keeps the same tokens (shared low-rank latents can follow)
    TEST_PARAMS = {"sink_tokens": 2, "window": 12}
    FUZZ = {"sink_tokens": (0, 6), "window": (1, 24)}

    sink_tokens: int = Int(4, low=0)
    window: int = Int(252, low=1)

    @property
    def name(self) -> str:
        return "sliding_window"

    @property
    def budget(self) -> int:
        return self.sink_tokens + self.window

    def covering(self, n_tokens: int) -> SlidingWindowPolicy:
        return dataclasses.replace(super().covering(n_tokens), window=max(self.window, n_tokens))

    def kept_tokens(self, s: Shape) -> int:
        """Sinks plus window: ``min(T, sink_tokens + window)``."""
        return min(s.total, self.budget)
