"""The one place that hooks attention (with ``cache.py``, the only code touching transformers internals).

transformers builds one mask for all layers from the first layer's sizes and the 2D padding mask. After
eviction, per-layer budgets or per-head lengths, that mask is wrong, so a registered attention function
``"kvcompress"`` masks from each policy layer's own state, runs the normal SDPA (or eager) kernel, and
hands eviction policies the scores they asked for. The matching mask function must be registered too:
without it transformers silently drops the causal mask.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvcompress import forward_state
from kvcompress.fused import decode_attention
from kvcompress.profiling import TIMER

NAME = "kvcompress"
BACKENDS = ("sdpa", "eager")
HOOKS = "_kvcompress_hooks"  # the model attribute holding install()'s hook handles


def _take_layer(module, kwargs: dict):
    """The policy layer that just stored this module's keys (this forward's own state), or None."""
    state = kwargs.pop(forward_state.KEY, None)
    return None if state is None else state.take(getattr(module, "layer_idx", -1))


def backend_of(config) -> str:
    return getattr(config, "kvcompress_backend", "sdpa")


def kvcompress_mask(*args, attention_mask=None, config=None, **kwargs):
    """Mask function: the backend's usual mask (policy layers mask from their own state instead; the
    forward's padding reaches them through ``forward_state``)."""
    fn = eager_mask if backend_of(config) == "eager" else sdpa_mask
    return fn(*args, attention_mask=attention_mask, config=config, **kwargs)


def _expand_heads(mask: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Per-KV-head masks (B, H_kv, q, T) become (B, H, q, T); shared masks stay (B, 1, q, T)."""
    if mask is None or mask.shape[1] in (1, num_heads):
        return mask
    return mask.repeat_interleave(num_heads // mask.shape[1], dim=1)


def eager_attention(module, query, key, value, mask, scaling):
    """Reference attention: softmax in float32, as the models' own eager path. Shapes (B, H, q, D)."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, q, T)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    elif query.shape[2] > 1:
        q, t = query.shape[2], key.shape[2]
        causal = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def window_scores(query, key, scaling: float, valid=None) -> torch.Tensor:
    """Attention probabilities of a step's last ``w`` queries, averaged over each KV group's query heads.

    Costs O(w x T) (never T x T) and is what score-based eviction (H2O, SnapKV, TOVA, block scoring) reads.

    Args:
        query: (B, H, w, D) the last ``w`` queries of the step; the last one sits at key position T - 1.
        key: (B, H_kv, T, D) the keys this step's attention read (after RoPE).
        scaling: the softmax scale the model uses.
        valid: (B, 1 or H_kv, T) bool, False for padding keys, or None.

    Returns:
        (B, H_kv, w, T) float32 probabilities: causal within the window, padding keys exactly 0, and
        all-zero rows for queries that are themselves padding.
    """
    b, h, w, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    g = h // h_kv
    q = query.reshape(b, h_kv, g * w, d).float()  # (B, H_kv, g*w, D): query heads of each group, stacked
    logits = torch.matmul(q, key.float().transpose(-1, -2)).view(b, h_kv, g, w, t)  # no per-head key copy
    logits.mul_(scaling)
    if w > 1 or valid is not None:
        kpos = torch.arange(t, device=key.device)
        allowed = kpos[None, :] <= (t - w + torch.arange(w, device=key.device))[:, None]  # (w, T) causal
        if valid is not None:
            allowed = allowed & valid[:, :, None, None, :]  # (B, h, 1, w, T)
        logits.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # fully masked rows (padding queries) become 0
    return probs.mean(dim=2)


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``"kvcompress"``: query (B, H, q, D), key/value (B, H_kv, T, D)."""
    layer = _take_layer(module, kwargs)
    if layer is not None:  # the layer may narrow what this query reads (Quest) and masks from its own state
        with TIMER.measure():
            key, value, attention_mask = layer.attend(query, key, value)
            attention_mask = _expand_heads(attention_mask, query.shape[1])
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if getattr(layer, "deferred", False):  # the store attends from its codes (kvcompress.fused_quant)
        if attention_mask is None and _fusable(module, kwargs):
            return layer.attend_codes(query, scaling), None
        with TIMER.measure():
            key, value = layer.read_deferred()
    wants = layer is not None and layer.observes()
    grouped = wants or getattr(layer, "grouped_decode", False)
    probs = None
    if grouped and query.shape[2] == 1 and attention_mask is None and _fusable(module, kwargs):
        out, probs = decode_attention(query, key, value, scaling, wants)  # one pass: output (and scores)
    elif backend_of(module.config) == "eager":
        out, _ = model_eager(module)(
            module,
            query,
            key,
            value,
            additive(attention_mask, query, key),
            scaling=scaling,
            dropout=dropout,
            **kwargs,
        )
    else:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if layer is not None and layer.probe is not None:  # fidelity diagnostics, before any eviction
        layer.probe.attended(layer, query, key, value, attention_mask, scaling, out)
    if wants:
        with TIMER.measure():
            layer.observe_attention(query, key, scaling, probs)  # the scores, handed to the layer itself
            layer.end_step()
    return out, None


def model_eager(module):
    """The model's own eager attention (its softcapping, sinks, dropout), else kvcompress's reference."""
    import sys

    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", eager_attention)


def additive(mask: torch.Tensor | None, query, key) -> torch.Tensor | None:
    """The additive float mask eager attention functions add to their logits: from a boolean mask, or the
    plain causal one when the mask is None (the models' eager functions never add causality themselves)."""
    q, t = query.shape[2], key.shape[2]
    if mask is None and q == 1:
        return None
    if mask is None:
        mask = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)[None, None]
    if mask.dtype != torch.bool:
        return mask
    zeros = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)
    return zeros.masked_fill_(~mask, torch.finfo(query.dtype).min)


def _fusable(module, kwargs) -> bool:
    """The fused decode path is used unless the model adds something to plain softmax attention
    (training dropout, logit soft-capping, learned attention sinks ``s_aux``)."""
    plain = not module.training and getattr(module.config, "attn_logit_softcapping", None) is None
    return plain and kwargs.get("s_aux") is None and getattr(module, "sinks", None) is None


def register() -> None:
    """Register the attention and mask functions (idempotent)."""
    AttentionInterface.register(NAME, kvcompress_attention)
    AttentionMaskInterface.register(NAME, kvcompress_mask)


def install(model) -> None:
    """Route ``model``'s attention through ``"kvcompress"``, keeping its sdpa/eager kernel as the backend, and
    hook its forward (and its base model's) so each forward hands its cache a fresh ``ForwardState``."""
    register()
    current = model.config._attn_implementation
    if current != NAME:
        model.config.kvcompress_backend = current if current in BACKENDS else "sdpa"
        model.set_attn_implementation(NAME)
    if not getattr(model, HOOKS, None):
        modules = {id(m): m for m in (model, getattr(model, "base_model", model))}.values()
        handles = [m.register_forward_pre_hook(forward_state.pre_hook, with_kwargs=True) for m in modules]
        setattr(model, HOOKS, handles)


def uninstall(model) -> None:
    """Undo ``install``: the model's own attention implementation again, no hooks (caches built for it then
    stop working with it)."""
    for handle in getattr(model, HOOKS, None) or ():
        handle.remove()
    setattr(model, HOOKS, None)
    if model.config._attn_implementation == NAME:
        model.set_attn_implementation(backend_of(model.config))


def set_backend(model, backend: str) -> None:
    """Choose the kernel behind ``"kvcompress"``: ``"sdpa"`` (default) or ``"eager"``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend={backend!r} is not supported; allowed: {list(BACKENDS)}")
    install(model)
    model.config.kvcompress_backend = backend
