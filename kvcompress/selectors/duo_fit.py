"""Rank a model's KV heads for ``duo``: which need every token (retrieval heads) and which only attention
sinks and a recent window (streaming heads).

Xiao et al., "DuoAttention" (arXiv 2410.10819), optimise one gate per KV head: each head's attention output is
``a * full + (1 - a) * streaming``, and the gates minimise the distance between the last hidden states of
this mixed model and the full one, plus ``LAMBDA`` times the gates' mean (pushing them to streaming), on a
task that needs retrieval (the paper: passkeys). Here the task is a text piece followed by a repeat of one of
its early spans, the distance taken over the repeat, where copying needs the far tokens. The cheaper
criterion ``mass`` is the attention the repeat's queries give a head's tokens outside its sinks and window.
Both are computed (the gates' agreement with the mass is reported) and saved with the fit's record.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvcompress.core.sources import digest
from kvcompress.resources.assets import cache_dir
from kvcompress.storage.low_rank.calibration import model_fingerprint
from kvcompress.storage.low_rank.calibration_files import save_atomic
from kvcompress.storage.low_rank.calibration_text import calibration_ids

CODE = ("kvcompress.selectors.duo_fit", "kvcompress.storage.low_rank.calibration_text")
CRITERIA = ("gates", "mass")
NAME = "kvcompress_duo_fit"  # the attention function the fit's forwards run with
LAMBDA = 0.05  # weight of the gates' mean in the loss (the paper's regularisation strength)
LR = 0.02  # Adam's step on the gates
RATIOS = (0.25, 0.5)  # retrieval shares at which the two criteria's chosen heads are compared
_MEMO: dict[str, dict] = {}


class FitState:
    """What the fit's attention function reads: the mode (``full``, ``mass``, ``gates``), the gates (L, H_kv),
    the streaming mask (T, T), the sinks and window, and the attention mass it adds up (L, H_kv)."""

    def __init__(self, layers: int, kv_heads: int, sinks: int, window: int, last: int):
        self.mode, self.sinks, self.window, self.last = "full", sinks, window, last
        self.gates = torch.ones(layers, kv_heads)  # made a leaf that requires grad by ``fit_gates``
        self.mass = torch.zeros(layers, kv_heads, dtype=torch.float64)
        self.stream_mask: torch.Tensor | None = None


def streaming_mask(t: int, sinks: int, window: int, device=None) -> torch.Tensor:
    """(T, T) bool: query ``i`` sees key ``j <= i`` that is a sink (``j < sinks``) or within ``window``
    tokens before it (``i - j <= window``), what a streaming head holds at a decode step."""
    i = torch.arange(t, device=device).view(-1, 1)
    j = torch.arange(t, device=device).view(1, -1)
    return (j <= i) & ((j < sinks) | (i - j <= window))


def far_mass(query, key, scaling: float, sinks: int, window: int) -> torch.Tensor:
    """Attention the queries (B, H, n, D), the last ``n`` of a sequence, give keys (B, H_kv, T, D) outside
    the sinks and the window: (H_kv,) float64, the mean over rows, queries and each KV head's query heads."""
    b, h, n, _ = query.shape
    t, h_kv = key.shape[-2], key.shape[1]
    k = key.repeat_interleave(h // h_kv, 1)
    logits = query.float() @ k.float().transpose(-1, -2) * scaling  # (B, H, n, T)
    i = torch.arange(t - n, t, device=query.device).view(-1, 1)
    j = torch.arange(t, device=query.device).view(1, -1)
    probs = torch.softmax(logits.masked_fill(j > i, -math.inf), dim=-1)
    far = (j >= sinks) & (i - j > window)  # (n, T)
    mass = (probs * far).sum(-1).mean(dim=(0, 2))  # (H,)
    return mass.view(h_kv, h // h_kv).mean(-1).double()


def attend(state: FitState, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The fit's attention (query (B, H, T, D), key/value (B, H_kv, T, D)): causal, and by ``state.mode``
    also adds up the far mass (``mass``) or mixes in the streaming output by the gates (``gates``)."""
    h, g = query.shape[1], query.shape[1] // key.shape[1]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)  # (B, H, T, D)
    layer = module.layer_idx
    if state.mode == "mass":
        state.mass[layer] += far_mass(
            query[:, :, -state.last :], key, scaling, state.sinks, state.window
        ).cpu()
    elif state.mode == "gates":
        stream = F.scaled_dot_product_attention(query, k, v, attn_mask=state.stream_mask, scale=scaling)
        a = state.gates[layer].to(query.device, query.dtype).clamp(0, 1).repeat_interleave(g).view(1, h, 1, 1)
        out = a * out + (1 - a) * stream
    return out.transpose(1, 2).contiguous(), None


def pieces(model, text: str, documents: int, tokens: int) -> tuple[list[torch.Tensor], int, dict]:
    """``documents`` inputs (1, tokens + n): a piece of the text's tail and a repeat of its span of ``n``
    tokens starting at ``tokens // 8``; returns them, ``n`` and the text range read."""
    ids, span = calibration_ids(model, text, documents * tokens)
    n, start = max(1, min(32, tokens // 4)), tokens // 8
    docs = []
    with torch.inference_mode(False):  # normal tensors, which the gates' backward may save
        for i in range(documents):
            piece = ids[:, i * tokens : (i + 1) * tokens].clone()
            docs.append(torch.cat([piece, piece[:, start : start + n]], dim=1).to(model.device))
    return docs, n, span


@functools.cache
def _registered() -> bool:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _dispatch)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return True


_STATES: list[FitState] = []  # the fit in progress (its forwards' attention reads it)


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    return attend(_STATES[-1], module, query, key, value, attention_mask, **kwargs)


class _FitForwards:
    """``with _FitForwards(model, state):`` the model's attention is the fit's, its weights frozen; both as
    they were afterwards."""

    def __init__(self, model, state: FitState):
        self.model, self.state = model, state

    def __enter__(self):
        _registered()
        self.implementation = self.model.config._attn_implementation
        self.flags = [(p, p.requires_grad) for p in self.model.parameters()]
        for p, _ in self.flags:
            p.requires_grad_(False)
        _STATES.append(self.state)
        self.model.set_attn_implementation(NAME)
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.implementation)
        _STATES.pop()
        for p, flag in self.flags:
            p.requires_grad_(flag)


def trainable(model):
    """``model``, or where its weights were made under inference mode (they cannot be saved for the gates'
    backward) a copy of it with normal tensors, used for the fit only."""
    if not any(p.is_inference() for p in model.parameters()):
        return model
    with torch.inference_mode(False):
        return copy.deepcopy(model)


def hidden(model, ids: torch.Tensor, last: int) -> torch.Tensor:
    """The base model's last hidden states (1, last, hidden) of ``ids``."""
    return model.base_model(ids, use_cache=False).last_hidden_state[:, -last:]


def fit_gates(model, docs, state: FitState, steps: int) -> dict:
    """The gates after ``steps`` Adam steps (cycling over ``docs``); the distillation loss first and last."""
    with torch.inference_mode(False), torch.no_grad():
        state.mode = "full"
        refs = [hidden(model, ids, state.last) for ids in docs]
    state.mode, losses = "gates", []
    with torch.inference_mode(False), torch.enable_grad():
        state.gates = torch.ones(state.gates.shape, requires_grad=True)  # not an inference tensor
        opt = torch.optim.Adam([state.gates], lr=LR)
        for step in tqdm(range(steps), desc="duo: fitting the gates", disable=steps < 10):
            ids, ref = docs[step % len(docs)], refs[step % len(docs)]
            state.stream_mask = streaming_mask(ids.shape[1], state.sinks, state.window, ids.device)
            out = hidden(model, ids, state.last)
            distill = (out.float() - ref.float()).square().mean() / ref.float().square().mean()
            loss = distill + LAMBDA * state.gates.clamp(0, 1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                state.gates.clamp_(0, 1)
            losses.append(float(distill.detach()))
    return {"gates": state.gates.detach().clone(), "distill_first": losses[0], "distill_last": losses[-1]}


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = (x.flatten().double().argsort().argsort().double() for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def top_heads(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """(L, H_kv) bool: the ``round(ratio * L * H_kv)`` heads of highest score over the whole model (ties: the
    first by layer, then head)."""
    n = round(ratio * scores.numel())
    flat = torch.zeros(scores.numel(), dtype=torch.bool)
    order = sorted(range(scores.numel()), key=lambda i: (-float(scores.flatten()[i]), i))
    flat[order[:n]] = True
    return flat.view(scores.shape)


def agreement(gates: torch.Tensor, mass: torch.Tensor) -> dict:
    """Spearman's rho of the two rankings, and the share of the gates' chosen heads the mass also chooses."""
    out = {"spearman": spearman(gates, mass)}
    for r in RATIOS:
        a, b = top_heads(gates, r), top_heads(mass, r)
        out[f"overlap_at_{r}"] = float((a & b).sum() / a.sum().clamp_min(1))
    return out


def fit(model, text: str, documents: int, tokens: int, steps: int, sinks: int, window: int) -> dict:
    """Both rankings (L, H_kv) float32 of ``model``'s KV heads and the fit's record."""
    start = time.perf_counter()
    cfg = model.config.get_text_config(decoder=True)
    docs, last, span = pieces(model, text, documents, tokens)
    state = FitState(cfg.num_hidden_layers, cfg.num_key_value_heads, sinks, window, last)
    model = trainable(model)
    with _FitForwards(model, state):
        state.mode = "mass"
        with torch.inference_mode():
            for ids in docs:
                model.base_model(ids, use_cache=False)
        mass = (state.mass / len(docs)).float()
        found = fit_gates(model, docs, state, steps)
    gates = found.pop("gates")
    return {
        "gates": gates, "mass": mass, "agreement": agreement(gates, mass), **found,
        "seconds": time.perf_counter() - start, "documents": documents, "tokens": tokens, "steps": steps,
        "range": span,
    }  # fmt: skip


def ranking(model, text, documents, tokens, steps, sinks, window, directory=None) -> dict:
    """The head rankings of ``model`` for these settings: from memory, from disk
    (``<directory or kvcompress cache>/calibration/duo-<key>.pt``, the key naming the code, the model and
    the settings), else fitted now and saved atomically. Adds ``source`` and ``path``."""
    ident = {"code": digest(CODE), "model": model_fingerprint(model), "text": text, "documents": documents,
             "tokens": tokens, "steps": steps, "sinks": sinks, "window": window}  # fmt: skip
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    path = (Path(directory) if directory else cache_dir() / "calibration") / f"duo-{key}.pt"
    if key in _MEMO:
        return {**_MEMO[key], "source": "memory"}
    saved = torch.load(path, weights_only=True) if path.exists() else None
    if isinstance(saved, dict) and saved.get("ident") == ident:
        result = {**saved, "source": "disk"}
    else:
        result = {**fit(model, text, documents, tokens, steps, sinks, window), "ident": ident}
        save_atomic(result, path)
        result["source"] = "computed"
    result["path"] = str(path)
    _MEMO[key] = result
    return result
