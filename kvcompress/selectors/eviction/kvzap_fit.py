"""Fit the learned scorer of ``kvzap``: per layer and KV head, a linear map from each stored pair's own key
and value to the log of its KVzip score.

Jegou et al., "KVzap" (arXiv 2601.07891), and Fast KVzip (arXiv 2601.17668), train a small model to predict
KVzip's scores (Kim et al., arXiv 2505.23416) so that compression needs no context pass. Here the inputs are
what the cache layer already holds at the prefill: the key's magnitude in each RoPE frequency pair (the
rotation by position leaves it unchanged) and the value; the model is ridge regression, solved in float64.

Targets: one forward over ``[context | repeat instruction | context]`` (``kvzip_prompts``, the prompts of the
context pass's first chunk): KVzip's score of a context pair is the most attention any query of the repeat
gives it (``kvzip_scores.max_attention``), exactly what the context pass computes for a context of at most
``kvzip.context_chunk`` tokens. Documents are consecutive pieces of the text's last tokens (the tail the
low-rank calibration reads, never the evaluation slices); the last ``holdout`` pieces are held out and
scored: R^2 of the log-score, Spearman's rank correlation, and the share of KVzip's own kept set that the
predicted ranking keeps at compression ratios 0.75 and 0.9.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcompress.core.layer import PolicyLayer
from kvcompress.core.policy import Policy, Shape
from kvcompress.core.sources import digest
from kvcompress.resources.assets import cache_dir
from kvcompress.selectors.eviction.kvzip_prompts import repeat_prompts
from kvcompress.selectors.eviction.kvzip_scores import max_attention
from kvcompress.storage.low_rank.calibration import model_fingerprint
from kvcompress.storage.low_rank.calibration_files import save_atomic
from kvcompress.storage.low_rank.calibration_text import calibration_ids, find_tokenizer

CODE = (
    "kvcompress.selectors.eviction.kvzap_fit",
    "kvcompress.selectors.eviction.kvzip_prompts",
    "kvcompress.selectors.eviction.kvzip_scores",
    "kvcompress.storage.low_rank.calibration_text",
)
FLOOR = 1e-8  # scores below are taken as this before the log (a pair no query attends to)
RIDGE = 1e-3  # ridge strength, relative to the mean diagonal of X^T X
RATIOS = (0.75, 0.9)
_MEMO: dict[str, dict] = {}


def features(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, T, D / 2 + D + 1) float32 of keys and values (B, H_kv, T, D): the key's norm in each RoPE
    pair ``(i, i + D / 2)`` (unchanged by the rotation), the value, and a constant."""
    k = key.float()
    half = k.shape[-1] // 2
    pairs = (k[..., :half].square() + k[..., half:].square()).sqrt()
    return torch.cat([pairs, value.float(), torch.ones_like(pairs[..., :1])], dim=-1)


def predict(weights: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Predicted log-scores (B, H_kv, T) float32 from one layer's ``weights`` (H_kv, F)."""
    return torch.einsum("bhtf,hf->bht", features(key, value), weights.to(key.device))


class TargetLayer(PolicyLayer):
    """Keeps every token; at the fit's forward, records its context pairs' features and KVzip scores."""

    wants_scores = True
    observed_probs = "none"

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        t = self.policy.context_tokens
        value = self.store.read()[1]
        self.features = features(key[:, :, :t], value[:, :, :t])[0]  # (H_kv, T, F)
        self.scores = max_attention(query[:, :, t:], key, scaling, t)[0]  # (H_kv, T)


@dataclass
class TargetPolicy(Policy):
    """The fit's own cache (never a registered policy): every token, in ``TargetLayer``s."""

    layer_class = TargetLayer
    context_tokens: int = field(default=0, repr=False)

    @property
    def name(self) -> str:
        return "kvzap-fit"

    def kept_tokens(self, s: Shape) -> int:
        return s.total


@torch.inference_mode()
def document_targets(model, ids: torch.Tensor, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (L, H_kv, T, F) and KVzip scores (L, H_kv, T) of the context ``ids`` (1, T)."""
    from kvcompress.core.cache import build_cache

    policy = TargetPolicy(apply_to="all", context_tokens=ids.shape[1])
    cache = build_cache(policy, model)
    full = torch.cat([ids, torch.tensor([prompt], dtype=ids.dtype), ids], dim=1).to(model.device)
    model(full, cache=cache, use_cache=True, logits_to_keep=1)
    feats = torch.stack([layer.features.cpu() for layer in cache.layers])
    return feats, torch.stack([layer.scores.cpu() for layer in cache.layers])


def solve(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Ridge weights (H, F) float32 for features ``x`` (H, N, F) and targets ``y`` (H, N), float64."""
    x, y = x.double(), y.double()
    gram = x.transpose(1, 2) @ x  # (H, F, F)
    reg = (
        RIDGE * gram.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(x.shape[-1], dtype=x.dtype)
    )
    return torch.linalg.solve(gram + reg, (x.transpose(1, 2) @ y[..., None]))[..., 0].float()


def log_scores(scores: torch.Tensor) -> torch.Tensor:
    return scores.clamp_min(FLOOR).log()


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).double()


def held_out_fit(weights: torch.Tensor, docs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """R^2 of the log-score, Spearman's rho, and kept-set recall at ``RATIOS``, means over held-out
    documents, layers and KV heads (``weights`` (L, H_kv, F))."""
    r2, rho, recall = [], [], {r: [] for r in RATIOS}
    for feats, scores in docs:
        pred = torch.einsum("lhtf,lhf->lht", feats, weights).double()
        true = log_scores(scores).double()
        resid = (true - pred).square().sum(-1)
        total = (true - true.mean(-1, keepdim=True)).square().sum(-1).clamp_min(1e-12)
        r2.append(float((1 - resid / total).mean()))
        a, b = _ranks(pred), _ranks(true)
        a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
        rho.append(float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)).mean()))
        t = true.shape[-1]
        for r in RATIOS:
            k = max(1, math.ceil((1 - r) * t))
            hit = torch.zeros_like(true, dtype=torch.bool).scatter_(-1, true.topk(k, -1).indices, True)
            got = hit.gather(-1, pred.topk(k, -1).indices).double().mean(-1)
            recall[r].append(float(got.mean()))
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    out = {"r2_log_score": mean(r2), "spearman": mean(rho)}
    return out | {f"recall_at_{r}": mean(v) for r, v in recall.items()}


def fit(model, text: str, documents: int, tokens: int, holdout: int, tokenizer=None) -> dict:
    """Fit on ``documents - holdout`` pieces of ``tokens`` tokens, score on the last ``holdout``. Returns
    ``{"weights": (L, H_kv, F) float32, "fit": held-out metrics, "seconds", "documents", "tokens"}``."""
    start = time.perf_counter()
    ids, span = calibration_ids(model, text, documents * tokens, tokenizer)
    tok = None if text == "random" else find_tokenizer(model, tokenizer)
    prompts = repeat_prompts(tok)
    docs = [document_targets(model, ids[:, i * tokens : (i + 1) * tokens], prompts.first + prompts.turn)
            for i in range(documents)]  # fmt: skip
    train = docs[: documents - holdout]
    x = torch.cat([f for f, _ in train], dim=2)  # (L, H_kv, N, F)
    y = torch.cat([log_scores(s) for _, s in train], dim=2)  # (L, H_kv, N)
    weights = torch.stack([solve(x[i], y[i]) for i in range(x.shape[0])])
    return {
        "weights": weights,
        "fit": held_out_fit(weights, docs[documents - holdout :]),
        "seconds": time.perf_counter() - start,
        "documents": documents,
        "holdout": holdout,
        "tokens": tokens,
        "range": span,
    }


def scorer(
    model, text: str, documents: int, tokens: int, holdout: int, directory=None, tokenizer=None
) -> dict:
    """The fitted scorer of ``model`` for these settings: from memory, from disk
    (``<directory or kvcompress cache>/calibration/kvzap-<key>.pt``, the key naming the code, the model and
    the settings), else fitted now and saved atomically. Adds ``source`` and ``path``."""
    ident = {"code": digest(CODE), "model": model_fingerprint(model), "text": text,
             "documents": documents, "tokens": tokens, "holdout": holdout}  # fmt: skip
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    path = (Path(directory) if directory else cache_dir() / "calibration") / f"kvzap-{key}.pt"
    if key in _MEMO:
        return {**_MEMO[key], "source": "memory"}
    saved = torch.load(path, weights_only=True) if path.exists() else None
    if isinstance(saved, dict) and saved.get("ident") == ident:
        result = {**saved, "source": "disk"}
    else:
        result = {**fit(model, text, documents, tokens, holdout, tokenizer), "ident": ident}
        save_atomic(result, path)
        result["source"] = "computed"
    result["path"] = str(path)
    _MEMO[key] = result
    return result
