"""A cache that keeps every token (as ``full``) and whose layers also measure the queries that read them, for
query-aware key bases.

A key error ``e`` changes the attention logit of query ``q`` by ``q . e``, so the key basis that keeps logits
best minimises ``E[(q . e)^2] = e^T M e`` with ``M`` the queries' second moment, not ``|e|^2``. With RoPE the
logit is ``q_pre^T R(n - m) k_pre`` (query at m, key at n), so for pre-RoPE keys ``M`` is the moment of the
query un-rotated at the key's position, ``R(-n) q_post``, averaged over keys ``n <= m`` (sampled here).
The layer gets its queries through the ordinary score hook (``observe_attention``), nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcompress.core.layer import PolicyLayer
from kvcompress.core.policy import Policy, Shape

SAMPLES = 8  # key positions drawn per query for the pre-RoPE moment


class QueryMomentLayer(PolicyLayer):
    """Stores every token; sums per KV head the second moments (H_kv, D, D) float64 of its queries
    (``post``) and of its queries un-rotated at sampled earlier key positions (``pre``)."""

    wants_scores = True

    def __init__(self, policy, layer_idx, spec, store):
        super().__init__(policy, layer_idx, spec, store)
        self.rope = policy.ropes[layer_idx] if policy.ropes else None
        self.sums = {"post": 0.0, "pre": 0.0}
        self.count = 0
        self.generator = torch.Generator().manual_seed(layer_idx)

    def _per_kv_head(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x x^T`` over rows and tokens, query heads folded onto their KV head: (H_kv, D, D)."""
        b, h, n, d = x.shape
        grouped = x.double().reshape(b, self.spec.num_kv_heads, h // self.spec.num_kv_heads * n, d)
        return torch.einsum("bktd,bkte->kde", grouped, grouped)

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        b, h, q, d = query.shape  # (B, H, q, D), post-RoPE, at positions seen - q .. seen - 1
        self.sums["post"] = self.sums["post"] + self._per_kv_head(query)
        self.count += b * q
        if self.rope is None:  # NoPE layer (or no RoPE at all): the logit sees the query as it is
            self.sums["pre"] = self.sums["pre"] + self._per_kv_head(query)
            return
        m = torch.arange(self.seen - q, self.seen).repeat_interleave(SAMPLES)  # (q * S,)
        n = (torch.rand(m.shape, generator=self.generator) * (m + 1)).long()  # keys at n <= m
        rep = query.float().repeat_interleave(SAMPLES, dim=2)  # (B, H, q * S, D)
        unrotated = self.rope.unrotate(rep, n.to(query.device).expand(b, h, -1))
        self.sums["pre"] = self.sums["pre"] + self._per_kv_head(unrotated) / SAMPLES

    def moments(self) -> dict[str, torch.Tensor]:
        """Mean second moments per query token and KV head (H_kv, D, D): ``post`` and ``pre``."""
        return {k: v / self.count for k, v in self.sums.items()}


@dataclass
class QueryMomentPolicy(Policy):
    """Keep every token (as ``full``) in ``QueryMomentLayer``s; ``ropes``: the model's per-layer ``Rope``
    (None: keys not un-rotatable, the pre-RoPE moment is the plain one)."""

    layer_class = QueryMomentLayer
    ropes: list | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return "calibration"  # the calibration pass's own cache, never a registered policy

    def kept_tokens(self, s: Shape) -> int:
        return s.total
