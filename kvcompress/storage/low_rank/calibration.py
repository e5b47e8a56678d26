"""Calibration moments for low-rank KV caches, computed once per model and text, then reused from disk.

The model runs once over calibration text with a ``full`` cache. Per layer the joint uncentred second
moments (H_kv * D, H_kv * D) of post-RoPE keys, pre-RoPE keys (the same keys un-rotated with the model's
own rotary embedding, ``kvcompress.storage.rope``) and values are kept, so any basis layout (per head,
per group, joint) and any rank or energy target is derived from one calibration
(``kvcompress.storage.low_rank.bases``). Results are keyed by the model (config and a sample of its weights),
the calibration token ids, the code that computes them and what is stored (``MOMENTS``, float32, their
shapes; ``kvcompress.storage.low_rank.calibration_files``), saved atomically under
``cache_dir()/calibration`` and reused;
each records the text range it read (``range``), so evaluation can refuse to overlap it. A file that cannot
be read, or whose key, names, dtypes or shapes are not this code's, is never used: it is computed again
(with a warning) and replaced.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from kvcompress.resources.assets import cache_dir
from kvcompress.storage.low_rank.calibration_files import code_version, read, save_atomic, stored_shapes
from kvcompress.storage.low_rank.calibration_text import RANDOM, calibration_ids

MOMENTS = ("keys_post", "keys_pre", "values", "queries_post", "queries_pre")
_MEMO: dict[str, dict] = {}

__all__ = ["RANDOM", "calibrate", "calibration_ids", "model_fingerprint", "second_moments"]


def model_fingerprint(model) -> str:
    """Hash of what shapes the keys: architecture, RoPE settings, a strided sample of each weight."""
    cfg = model.config.get_text_config(decoder=True)
    h = hashlib.sha256()
    for attr in ("model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim"):
        h.update(repr(getattr(cfg, attr, None)).encode())
    for attr in ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "no_rope_layers"):
        h.update(repr(getattr(cfg, attr, None)).encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 256)][:256].float().cpu()
        h.update(name.encode() + repr(tuple(p.shape)).encode() + sample.numpy().tobytes())
    return h.hexdigest()


def _moment(x: torch.Tensor) -> torch.Tensor:
    """Joint second moment (H * D, H * D) float64 of ``x`` (H, T, D)."""
    flat = x.double().transpose(0, 1).reshape(x.shape[1], -1)  # (T, H * D)
    return flat.T @ flat / flat.shape[0]


def _ropes(model, num_layers: int):
    """The model's per-layer ``Rope`` (None for NoPE layers), or None when keys cannot be un-rotated."""
    from kvcompress.storage.rope import model_ropes

    try:
        return model_ropes(model, num_layers)
    except ValueError:
        return None


@torch.inference_mode()
def second_moments(model, ids: torch.Tensor, chunk: int = 1024) -> dict[str, torch.Tensor | None]:
    """Moments of ``MOMENTS`` from one ``full`` pass over ``ids``, float32: keys and values joint over a
    layer's KV heads (L, H_kv * D, H_kv * D); queries per KV head (L, H_kv, D, D) (``calibration_queries``).
    ``keys_pre`` is None when the model's RoPE cannot be inverted."""
    from kvcompress.core.cache import build_cache, model_spec
    from kvcompress.storage.low_rank.calibration_queries import QueryMomentPolicy

    ropes = _ropes(model, model_spec(model).num_layers)
    cache = build_cache(QueryMomentPolicy(ropes=ropes, apply_to="all"), model)  # every layer keeps all
    for start in range(0, ids.shape[1], chunk):
        model(ids[:, start : start + chunk].to(model.device), cache=cache, use_cache=True)
    out = {name: [] for name in MOMENTS}
    for i, layer in enumerate(cache.layers):
        queries = layer.moments()
        out["queries_post"].append(queries["post"])
        out["queries_pre"].append(queries["pre"])
        keys, values = layer.keys[:1], layer.values[:1]  # (1, H_kv, T, D), positions 0..T-1
        out["keys_post"].append(_moment(keys[0]))
        out["values"].append(_moment(values[0]))
        if ropes is not None:
            rope = ropes[i]
            pos = torch.arange(keys.shape[2], device=keys.device).expand(1, keys.shape[1], -1)
            out["keys_pre"].append(_moment((keys.float() if rope is None else rope.unrotate(keys, pos))[0]))
    return {k: torch.stack(v).float().cpu() if v else None for k, v in out.items()}


def calibrate(model, text: str, n_tokens: int, directory: str | Path | None = None, tokenizer=None) -> dict:
    """Moments of keys (post- and pre-RoPE) and values per layer, computed once and then reused from disk.

    Returns a dict with the ``MOMENTS`` (L, H_kv * D, H_kv * D), ``range`` (the text span read, see
    ``calibration_ids``), ``seconds`` (time of the calibration pass when it ran), ``tokens``, and
    ``source``: ``"computed"``, ``"disk"`` or ``"memory"``.
    """
    ids, span = calibration_ids(model, text, n_tokens, tokenizer)
    ident = {"code": code_version(), "model": model_fingerprint(model), "text": text}
    ident["ids"] = hashlib.sha256(ids.numpy().astype("int64").tobytes()).hexdigest()
    ident["stored"] = {"dtype": "float32", "shapes": stored_shapes(model, MOMENTS)}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    path = Path(directory) if directory else cache_dir() / "calibration"
    path = path / f"kv-moments-{key}.pt"
    if key in _MEMO and path.exists():
        return {**_MEMO[key], "source": "memory"}
    result = read(path, ident) if path.exists() else None
    if result is None:
        start = time.perf_counter()
        result = second_moments(model, ids)
        result.update(seconds=time.perf_counter() - start, tokens=ids.shape[1], ident=ident, range=span)
        save_atomic(result, path)
        result["source"] = "computed"
    result.setdefault("bases", {})  # eigenbases derived from the moments, shared by later builds
    _MEMO[key] = result
    return result
