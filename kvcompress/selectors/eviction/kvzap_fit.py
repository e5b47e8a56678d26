"""Train ``kvzap``'s surrogates on a model: KVzip+ targets over a text's tail, a ridge and an MLP fit, the
held-out fit, and the versioned artifact that holds them.

Jegou et al., "KVzap" (arXiv 2601.07891), as its training script (kvpress ``kvzap/train.py``) does it:
documents of equal length (so attention's denominators do not vary with length), ``sample`` random tokens of
each training document, both surrogates fitted on the same pairs (``kvzap_model``), scored on held-out
documents (every token): R^2 of the log-score and Pearson's correlation, per layer, and the share of the
kept set of the true KVzip+ ranking that the predicted ranking keeps at compression ratios 0.75 and 0.9.
Documents are consecutive pieces of the text's last tokens (the tail the low-rank calibration reads, never
the evaluation slices); the last ``holdout`` pieces are held out.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch

from kvcompress.core.sources import digest
from kvcompress.resources.assets import cache_dir
from kvcompress.selectors.eviction import kvzap_model
from kvcompress.selectors.eviction.kvzap_targets import document_targets
from kvcompress.selectors.eviction.kvzip_prompts import repeat_prompts
from kvcompress.storage.low_rank.calibration import model_fingerprint
from kvcompress.storage.low_rank.calibration_files import save_atomic
from kvcompress.storage.low_rank.calibration_text import RANDOM, calibration_ids, find_tokenizer

VERSION = 2  # 1: the key-and-value linear map; 2: hidden states -> KVzip+ (linear and MLP)
CODE = (
    "kvcompress.selectors.eviction.kvzap_fit",
    "kvcompress.selectors.eviction.kvzap_model",
    "kvcompress.selectors.eviction.kvzap_targets",
    "kvcompress.selectors.eviction.kvzip_prompts",
    "kvcompress.storage.low_rank.calibration_text",
)
RATIOS = (0.75, 0.9)
_MEMO: dict[str, dict] = {}


def held_out(params: dict, docs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Per-layer held-out fit over ``docs`` (features (L, C, F), log-scores (L, C, H_kv)), each a mean over
    documents and KV heads: ``r2``, ``pearson``, ``recall_at_<r>``; and their means over layers."""
    per = {"r2": [], "pearson": [], **{f"recall_at_{r}": [] for r in RATIOS}}
    for feats, true in docs:
        pred = kvzap_model.predict_all(params, feats).double().transpose(1, 2)  # (L, H_kv, C)
        true = true.double().transpose(1, 2)
        dt, dp = true - true.mean(-1, keepdim=True), pred - pred.mean(-1, keepdim=True)
        per["r2"].append(1 - (true - pred).square().sum(-1) / dt.square().sum(-1).clamp_min(1e-12))
        per["pearson"].append((dt * dp).sum(-1) / (dt.norm(dim=-1) * dp.norm(dim=-1)).clamp_min(1e-12))
        for r in RATIOS:
            k = max(1, math.ceil((1 - r) * true.shape[-1]))
            hit = torch.zeros_like(true, dtype=torch.bool).scatter_(-1, true.topk(k, -1).indices, True)
            per[f"recall_at_{r}"].append(hit.gather(-1, pred.topk(k, -1).indices).double().mean(-1))
    layers = {name: torch.stack(v).mean(dim=(0, 2)) for name, v in per.items()}  # (L,)
    out = {name: float(v.mean()) for name, v in layers.items()}
    return out | {"per_layer": {name: [round(float(x), 4) for x in v] for name, v in layers.items()}}


def collect(model, text: str, documents: int, tokens: int, tokenizer=None) -> tuple[list, dict]:
    """(features, log-scores) of each of ``documents`` pieces of ``tokens`` tokens, and their text range."""
    ids, span = calibration_ids(model, text, documents * tokens, tokenizer)
    prompts = repeat_prompts(None if text == RANDOM else find_tokenizer(model, tokenizer))
    docs = [document_targets(model, ids[:, i * tokens : (i + 1) * tokens], prompts) for i in range(documents)]
    return docs, span


def fit(
    model, text: str, documents: int, tokens: int, holdout: int, sample: int, tokenizer=None, mlp=None
) -> dict:
    """Both surrogates fitted on ``sample`` random tokens of each of the first ``documents - holdout``
    pieces, scored on the last ``holdout``. ``mlp``: overrides of ``kvzap_model.MLP`` (tests)."""
    start = time.perf_counter()
    docs, span = collect(model, text, documents, tokens, tokenizer)
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(tokens, generator=gen)[:sample] for _ in docs[: documents - holdout]]
    x = torch.cat([f[:, p] for (f, _), p in zip(docs, picks, strict=False)], dim=1)  # (L, N, hidden)
    y = torch.cat([s[:, p] for (_, s), p in zip(docs, picks, strict=False)], dim=1)  # (L, N, H_kv)
    targets_s = time.perf_counter() - start
    out = {
        "documents": documents,
        "holdout": holdout,
        "tokens": tokens,
        "sample": sample,
        "range": span,
        "train_pairs": x.shape[1],
        "targets_seconds": round(targets_s, 1),
        "fit": {},
        "seconds": {},
    }
    for kind, train in (("linear", kvzap_model.fit_linear), ("mlp", kvzap_model.fit_mlp)):
        began = time.perf_counter()
        out[kind] = train(x, y) if kind == "linear" else train(x, y, **(mlp or {}))
        out["seconds"][kind] = round(time.perf_counter() - began, 1)
        out["fit"][kind] = held_out(out[kind], docs[documents - holdout :])
    return out


def scorer(
    model,
    text: str,
    documents: int,
    tokens: int,
    holdout: int,
    sample: int,
    directory=None,
    tokenizer=None,
    mlp=None,
) -> dict:
    """The trained surrogates of ``model`` for these settings: from memory, from disk
    (``<directory or kvcompress cache>/calibration/kvzap-v2-<key>.pt``, the key naming the version, the code,
    the model and the settings), else trained now and saved atomically. Adds ``source`` and ``path``."""
    ident = {
        "version": VERSION,
        "code": digest(CODE),
        "model": model_fingerprint(model),
        "text": text,
        "documents": documents,
        "tokens": tokens,
        "holdout": holdout,
        "sample": sample,
        "mlp": mlp,
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    path = (Path(directory) if directory else cache_dir() / "calibration") / f"kvzap-v{VERSION}-{key}.pt"
    if key in _MEMO:
        return {**_MEMO[key], "source": "memory"}
    saved = torch.load(path, weights_only=True) if path.exists() else None
    if isinstance(saved, dict) and saved.get("ident") == ident:
        result = {**saved, "source": "disk"}
    else:
        result = {**fit(model, text, documents, tokens, holdout, sample, tokenizer, mlp), "ident": ident}
        save_atomic(result, path)
        result["source"] = "computed"
    result["path"] = str(path)
    _MEMO[key] = result
    return result
