"""A second example selector in one file (plus ``conf/policy/keydiff_example.yaml``, its ``_target_`` alone):
one that computes a statistic over the stored tokens, and so must leave the padding slots of a batch out.

KeyDiff: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv 2504.15364, keep the keys least similar to the layer's mean key
(the most distinctive ones) and evict the most similar, with no attention score. The mean is taken over each
row's real tokens only (``PolicyLayer.valid``): a mean over padding slots would rank a padded row's tokens
differently from the same row alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from kvcompress.selectors.eviction.base import EvictionLayer, EvictionPolicy


class KeyDiffLayer(EvictionLayer):
    """Ranks the stored keys (B, H_kv, T, D) by their cosine similarity to the mean of the real ones."""

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        k = self.target()
        if self.stored_length() > k:
            unit = F.normalize(key.float(), dim=-1)  # (B, H_kv, T, D)
            if self.valid is None:  # no padding stored: every slot is a token
                anchor = unit.mean(-2, keepdim=True)  # (B, H_kv, 1, D)
            else:  # (B, 1 or H_kv, T): False on padding slots, broadcast over the heads
                real = self.valid[..., None].float()
                anchor = (unit * real).sum(-2, keepdim=True) / real.sum(-2, keepdim=True).clamp_min(1)
            self.select(-F.cosine_similarity(unit, anchor, dim=-1), k)  # (B, H_kv, T)


@dataclass
class KeyDiffPolicy(EvictionPolicy):  # budget / compression_ratio / unit come with EvictionPolicy
    """Keep the keys least similar to their row's mean key (KeyDiff, Park et al., arXiv 2504.15364)."""

    layer_class = KeyDiffLayer
    FORMULA = True  # the inherited kept_tokens()/state_bytes() describe it exactly
    TEST_PARAMS = {"budget": 12, "compression_ratio": None}  # makes a 48-token test compress
