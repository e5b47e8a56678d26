"""Decode attention from rotated codes (``core.plan.Rotated``, ``storage.quant.turbo``): no key or value is
rotated back.

The rotation is orthogonal, so a query's logit over a stored key is the rotated query's over the rotated key:
the query is turned once per step (``Rotation.forward``), its logits over the per-token codes are
``fused_quant``'s sums (the C++ kernel or matmul), plus, with the sketch, ``core.rotation.sketch_logits``
(the query's product with each key's residual estimate). The probabilities weight the rotated values' codes,
and that one output vector per query is turned back (``Rotation.inverse``); the residual window joins the
same softmax unrotated. Zandieh et al., TurboQuant, arXiv 2504.19874; QJL, arXiv 2406.03482.
"""

from __future__ import annotations

import torch

from kvcompress.core.rotation import sketch_logits
from kvcompress.kernels import fused_quant


def attend(query, read, scaling: float, impl: str, scores: bool = False):
    """One decode query (B, H, 1, D) over ``read``'s codes then its residual window, softmax in float32.
    ``impl``: ``matmul`` (torch) or ``kernel`` (C++, CPU). Returns (B, 1, H, D) in the query's dtype and,
    with ``scores``, the probabilities averaged over each KV group's heads (B, H_kv, 1, Te + Tr) float32."""
    b, h, _, d = query.shape
    h_kv = read.key_res.shape[1]
    q = query.reshape(b, h_kv, h // h_kv, d).float() * scaling  # (B, H_kv, g, D)
    turned = read.rotation.forward(q)
    built = fused_quant.built_module() if impl == "kernel" else None
    keys = read.keys
    logits_q = fused_quant.sums(impl, "key_logits_token", turned, keys[:3], read.bits, read.group, built)
    if len(keys) > 3:
        logits_q = logits_q + sketch_logits(turned, keys[3], keys[4], read.projection)  # (B, H_kv, g, Te)
    logits_r = torch.matmul(q, read.key_res.float().transpose(-1, -2))  # (B, H_kv, g, Tr)
    probs = torch.softmax(torch.cat([logits_q, logits_r], -1), -1)
    te = logits_q.shape[-1]
    out = fused_quant.sums(impl, "value_output", probs[..., :te], read.values, read.bits, read.group, built)
    out = read.rotation.inverse(out) + torch.matmul(probs[..., te:], read.value_res.float())
    out = out.reshape(b, 1, h, d).to(query.dtype)
    return out, probs.mean(dim=2, keepdim=True) if scores else None


def plan_attention(plan, call):
    """``attend`` through the C++ kernel: the ``cpu`` backend's kernel for rotated reads."""
    return attend(call.query, plan.read, call.scaling, "kernel", plan.probs == "last")
