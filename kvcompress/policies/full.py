"""The uncompressed baseline: every ratio is measured against it."""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer


@dataclass
class FullPolicy(Policy):
    """Keep every token in the model's dtype (what ``DynamicCache`` does)."""

    def layer(self, layer_idx: int, spec: ModelSpec) -> PolicyLayer:
        return PolicyLayer(self, layer_idx, spec)
