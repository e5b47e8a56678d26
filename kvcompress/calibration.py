"""Calibrated projection bases for low-rank KV caches.

The model runs once over calibration text with a ``full`` cache; the post-RoPE keys and the values of
every layer and KV head give a second-moment matrix whose eigenvectors (largest first) are the basis. The
complete basis and its eigenvalues are kept, so any rank or energy target is a slice of one calibration:
results are keyed by the model (config and a sample of its weights) and the calibration token ids, saved
atomically under ``cache_dir()/calibration`` and reused by later runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from kvcompress.assets import cache_dir

VERSION = 1  # bump when the stored content changes
RANDOM = "random"
_MEMO: dict[str, dict] = {}


def calibration_ids(model, text: str, n_tokens: int) -> torch.Tensor:
    """Token ids (1, n_tokens): the *last* ``n_tokens`` of ``text`` (evaluation reads texts from the start,
    so the two do not overlap), or seeded uniform ids for ``text="random"`` (tests, no tokenizer)."""
    if text == RANDOM:
        vocab = model.config.get_text_config(decoder=True).vocab_size
        return torch.randint(0, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    from kvcompress.data import load_text

    source = getattr(model, "name_or_path", "")
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"low_rank.calibration_text={text!r} needs the model's tokenizer, which could not be loaded from "
            f"{source!r} ({err}); use calibration_text='random' for a model without one"
        ) from err
    body = load_text(text)
    ids = tok(body[-n_tokens * 16 :], return_tensors="pt").input_ids  # a tail slice: no full tokenization
    if ids.shape[1] < n_tokens:
        raise ValueError(
            f"low_rank.calibration_tokens={n_tokens}: text {text!r} has only {ids.shape[1]} tokens"
        )
    return ids[:, -n_tokens:]


def model_fingerprint(model) -> str:
    """Hash of what shapes post-RoPE keys: architecture, RoPE settings, a strided sample of each weight."""
    cfg = model.config.get_text_config(decoder=True)
    h = hashlib.sha256()
    for attr in ("model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim"):
        h.update(repr(getattr(cfg, attr, None)).encode())
    for attr in ("rope_parameters", "rope_theta", "rope_scaling"):
        h.update(repr(getattr(cfg, attr, None)).encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 256)][:256].float().cpu()
        h.update(name.encode() + repr(tuple(p.shape)).encode() + sample.numpy().tobytes())
    return h.hexdigest()


@torch.inference_mode()
def second_moments(model, ids: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Uncentred second moments of keys and values, each (L, H_kv, D, D) float64, from one ``full`` pass."""
    from kvcompress.cache import build_cache

    cache = build_cache("full", model)
    for start in range(0, ids.shape[1], chunk):
        model(ids[:, start : start + chunk].to(model.device), cache=cache, use_cache=True)
    moments = []
    for layer in cache.layers:
        k, v = layer.keys[0].double(), layer.values[0].double()  # (H_kv, T, D)
        moments.append((k.mT @ k / k.shape[1], v.mT @ v / v.shape[1]))
    keys, values = zip(*moments, strict=True)
    return torch.stack(keys).cpu(), torch.stack(values).cpu()


def eigenbasis(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenbasis (..., D, D) of ``moment`` (columns by decreasing eigenvalue) and eigenvalues (..., D)."""
    values, vectors = torch.linalg.eigh(moment)
    return vectors.flip(-1).float(), values.flip(-1).clamp(min=0).float()


def rank_for_energy(eigenvalues: torch.Tensor, energy: float) -> int:
    """Smallest r whose leading eigenvalues (H_kv, D) hold ``energy`` of the total in every head."""
    share = eigenvalues.cumsum(-1) / eigenvalues.sum(-1, keepdim=True).clamp(min=1e-30)
    per_head = (share < energy - 1e-6).sum(-1) + 1  # tolerance: energy=1.0 must reach head_dim exactly
    return int(per_head.clamp(max=eigenvalues.shape[-1]).max())


def calibrate(model, text: str, n_tokens: int, directory: str | Path | None = None) -> dict:
    """Bases of keys and values per layer and KV head, computed once and then reused from disk.

    Returns a dict with ``key_basis``/``value_basis`` (L, H_kv, D, D), ``key_energy``/``value_energy``
    (L, H_kv, D) eigenvalues, ``seconds`` (time of the calibration pass when it ran), ``tokens``, and
    ``source``: ``"computed"``, ``"disk"`` or ``"memory"``.
    """
    ids = calibration_ids(model, text, n_tokens)
    ident = {"version": VERSION, "model": model_fingerprint(model), "text": text}
    ident["ids"] = hashlib.sha256(ids.numpy().astype("int64").tobytes()).hexdigest()
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    path = Path(directory) if directory else cache_dir() / "calibration"
    path = path / f"kv-basis-{key}.pt"
    if key in _MEMO and path.exists():
        return {**_MEMO[key], "source": "memory"}
    if path.exists():
        result = {**torch.load(path, weights_only=True), "source": "disk"}
    else:
        start = time.perf_counter()
        k_moment, v_moment = second_moments(model, ids)
        (kb, ke), (vb, ve) = eigenbasis(k_moment), eigenbasis(v_moment)
        result = {"key_basis": kb, "key_energy": ke, "value_basis": vb, "value_energy": ve}
        result.update(seconds=time.perf_counter() - start, tokens=ids.shape[1], ident=ident)
        _save_atomic(result, path)
        result["source"] = "computed"
    _MEMO[key] = result
    return result


def _save_atomic(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
