"""KVzap's training pairs: each context token's attention input (the features) and its KVzip+ log-score.

Jegou et al., "KVzap" (arXiv 2601.07891), section 3 and the training script kvpress publishes
(``kvzap/data.py``): one forward over KVzip's reconstruction prompt ``[opening | context | repeat
instruction | turn | context]`` (Kim et al., arXiv 2505.23416). KVzip+ scores a context pair ``k`` of query
head ``h`` by the attention ``p`` each query ``t`` of the repeated context gives it, normalised by what it
adds to the residual stream: ``p[h, t, k] * ||W_o[h] v[k]|| / ||x[t]||`` (``x``: the query token's attention
input), then takes the most over the repeat's queries and over the query heads of a KV group, and the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcompress.core.layer import PolicyLayer
from kvcompress.core.policy import Policy, Shape

FLOOR = (
    1e-12  # a pair that adds nothing (a zero value, as a padding embedding gives) scores this before the log
)


def output_norms(value: torch.Tensor, o_proj: torch.Tensor, heads: int) -> torch.Tensor:
    """``||W_o[h] v||`` (H, T) float32 of values (H_kv, T, D) through ``o_proj`` weights (hidden, H * D)."""
    h_kv, _, d = value.shape
    v = value.float().repeat_interleave(heads // h_kv, dim=0)  # (H, T, D)
    w = o_proj.float().t().reshape(heads, d, -1)  # (H, D, hidden)
    return torch.einsum("htd,hdo->hto", v, w).norm(dim=-1)


def kvzip_plus(query, key, value, hidden, o_proj, context: tuple[int, int], repeat: tuple[int, int], scaling):
    """KVzip+ log-scores (H_kv, C) of the ``context`` keys, read by the ``repeat`` queries.

    Args:
        query: (H, T, D) every query of the forward (after RoPE); key/value: (H_kv, T, D).
        hidden: (T, hidden) the attention's input; o_proj: (hidden, H * D) the output projection's weight.
        context / repeat: [start, end) token ranges of the context and of its repetition.
    """
    heads, h_kv = query.shape[0], key.shape[0]
    (cs, ce), (rs, re) = context, repeat
    keys = key[:, :re].float().repeat_interleave(heads // h_kv, dim=0)  # (H, re, D)
    logits = query[:, rs:re].float() @ keys.transpose(1, 2) * scaling  # (H, R, re)
    later = torch.arange(re)[None, :] > torch.arange(rs, re)[:, None]  # (R, re): causal
    probs = logits.masked_fill(later, float("-inf")).softmax(dim=-1)[..., cs:ce]  # (H, R, C)
    probs = probs / hidden[rs:re].float().norm(dim=-1).clamp_min(1e-6)[None, :, None]  # a zero row: padding
    scores = probs.amax(dim=1) * output_norms(value[:, cs:ce], o_proj, heads)  # (H, C)
    return scores.view(h_kv, heads // h_kv, -1).amax(dim=1).clamp_min(FLOOR).log()


class TargetLayer(PolicyLayer):
    """Keeps every token; at the fit's forward, records its context tokens' attention inputs and targets."""

    wants_scores = True
    wants_hidden = True
    observed_probs = "none"

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        p = self.policy
        hidden, value = self.hidden[0], self.store.read()[1][0]  # (T, hidden), (H_kv, T, D)
        self.targets = kvzip_plus(query[0], key[0], value, hidden, p.o_proj[self.layer_idx], p.context,
                                  p.repeat, scaling)  # fmt: skip
        self.features = hidden[p.context[0] : p.context[1]].float()  # (C, hidden)
        self.hidden = None


@dataclass
class TargetPolicy(Policy):
    """The fit's own cache (never a registered policy): every token, in ``TargetLayer``s."""

    layer_class = TargetLayer
    context: tuple[int, int] = field(default=(0, 0), repr=False)
    repeat: tuple[int, int] = field(default=(0, 0), repr=False)
    o_proj: list = field(default_factory=list, repr=False)  # (hidden, H * D) per layer

    @property
    def name(self) -> str:
        return "kvzap-fit"

    def kept_tokens(self, s: Shape) -> int:
        return s.total


def o_proj_weights(model) -> list[torch.Tensor]:
    """Each decoder layer's attention output projection weight (hidden, H * D)."""
    from kvcompress.core.attention import attention_modules

    return [m.o_proj.weight.detach() for m in sorted(attention_modules(model), key=lambda m: m.layer_idx)]


@torch.inference_mode()
def document_targets(model, ids: torch.Tensor, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (L, C, hidden) float32 and KVzip+ log-scores (L, C, H_kv) of the context ``ids`` (1, C);
    ``prompts``: ``kvzip_prompts.Prompts`` (empty lists without a tokenizer)."""
    from kvcompress.core.cache import build_cache

    head, mid = prompts.opening, prompts.first + prompts.turn
    c = ids.shape[1]
    start, repeat = len(head), len(head) + c + len(mid)
    policy = TargetPolicy(apply_to="all", context=(start, start + c), repeat=(repeat, repeat + c),
                          o_proj=o_proj_weights(model))  # fmt: skip
    cache = build_cache(policy, model)
    as_ids = lambda x: torch.tensor([x], dtype=ids.dtype)  # noqa: E731
    full = torch.cat([as_ids(head), ids, as_ids(mid), ids], dim=1).to(model.device)
    model(full, cache=cache, use_cache=True, logits_to_keep=1)
    feats = torch.stack([layer.features.cpu() for layer in cache.layers])
    return feats, torch.stack([layer.targets.t().cpu() for layer in cache.layers])
