"""StreamingLLM: attention sinks plus a sliding window of recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer


@dataclass
class SlidingWindowPolicy(Policy):
    """Keep the first ``sink_tokens`` real tokens and the last ``window`` tokens; evict the rest."""

    sink_tokens: int = 4
    window: int = 252

    def __post_init__(self):
        self.require_ints(sink_tokens=0, window=1)

    @property
    def name(self) -> str:
        return "sliding_window"

    @property
    def budget(self) -> int:
        return self.sink_tokens + self.window

    def covering(self, n_tokens: int) -> SlidingWindowPolicy:
        return SlidingWindowPolicy(self.sink_tokens, max(self.window, n_tokens))

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        return SlidingWindowLayer(self, layer_idx, spec)


class SlidingWindowLayer(PolicyLayer):
    """Evicts after each step so that at most ``sink_tokens + window`` tokens stay stored."""

    def compress(self) -> None:
        total, budget = self.stored_length(), self.policy.budget
        if total <= budget:
            return
        if self.valid is None:  # no padding: sinks are the first tokens, two slice copies
            self.keep_spans([(0, self.policy.sink_tokens), (total - self.policy.window, total)])
            return
        self.keep(self._priority(total).topk(budget, dim=-1).indices)

    def _priority(self, total: int) -> torch.Tensor:
        """Per row (B, 1, T): sinks (first real tokens) > recent window > older real tokens > padding."""
        valid = self.valid[:, :1]  # validity is shared by heads for this policy
        t = torch.arange(total, device=self.device)
        rank = valid.cumsum(-1)
        sink = valid & (rank <= self.policy.sink_tokens)
        recent = t >= total - self.policy.window
        older = t.float() / total  # among the rest prefer newer tokens
        return valid * (1.0 + older) + recent * 2.0 * valid + sink * 4.0
