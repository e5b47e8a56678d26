"""Where calibrations live on disk: the key of a calibration (the code that computes it and what it stores),
the checks a file passes before it is used, and the atomic write.

The key holds the digest (``kvcompress.core.sources``) of ``CODE`` and of the modules defining the calibration
pass's classes and their bases, so a change to any of them computes the moments again instead of reusing
stale ones; a file that cannot be read, was computed under another key, or holds a moment of another name,
dtype or shape is never used (``read`` warns and returns None: the caller computes it again).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import torch

# Modules whose code computes the stored moments beyond the classes of the pass (``code_version``): the text
# tail and its range, the text loader, RoPE inversion, and the attention hook that hands queries over.
CODE = (
    "kvcompress.storage.low_rank.calibration",
    "kvcompress.storage.low_rank.calibration_files",
    "kvcompress.storage.low_rank.calibration_queries",
    "kvcompress.storage.low_rank.calibration_text",
    "kvcompress.resources.data",
    "kvcompress.storage.rope",
    "kvcompress.storage.rope_table",
    "kvcompress.core.attention",
)


def code_version() -> str:
    """Digest of the code that computes the moments: ``CODE`` and the modules defining the calibration
    pass's policy, layer, storage and store classes and their bases."""
    from kvcompress.core.sources import class_modules, digest
    from kvcompress.storage.dense import DenseStorage, DenseStore
    from kvcompress.storage.low_rank.calibration_queries import QueryMomentLayer, QueryMomentPolicy

    return digest(set(CODE) | class_modules(QueryMomentLayer, QueryMomentPolicy, DenseStorage, DenseStore))


def stored_shapes(model, names) -> dict[str, list[int]]:
    """The shape of every moment in ``names`` that ``calibration.second_moments`` stores for ``model``
    (float32): keys and values joint over a layer's KV heads, queries per KV head."""
    from kvcompress.core.cache import model_spec

    spec = model_spec(model)
    n, h, d = spec.num_layers, spec.num_kv_heads, spec.head_dim
    joint, per_head = [n, h * d, h * d], [n, h, d, d]
    return {name: per_head if name.startswith("queries") else joint for name in names}


def read(path: Path, ident: dict) -> dict | None:
    """The calibration saved at ``path`` if it is readable and is what ``ident`` describes; None, with a
    warning, otherwise."""
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as err:  # torch.load raises many types for a truncated or foreign file
        return _unusable(path, f"it cannot be read ({type(err).__name__}: {str(err)[:200]})")
    if not isinstance(saved, dict) or saved.get("ident") != ident:
        return _unusable(path, "it was computed for another model, text or calibration code (stale)")
    wrong = _wrong_moment(saved, ident["stored"]["shapes"])
    return _unusable(path, wrong) if wrong else {**saved, "source": "disk"}


def _wrong_moment(saved: dict, shapes: dict) -> str | None:
    """What is wrong with the first moment of ``saved`` that is not float32 of its shape in ``shapes``
    (``keys_pre`` may be None: the model's RoPE cannot be inverted), or None."""
    for name, shape in shapes.items():
        t = saved.get(name)
        if t is None and name == "keys_pre" and name in saved:
            continue
        if not isinstance(t, torch.Tensor):
            return f"its {name!r} is {type(t).__name__ if name in saved else 'missing'}, not a {shape} tensor"
        if t.dtype != torch.float32 or list(t.shape) != shape:
            return f"its {name!r} is {t.dtype} {list(t.shape)}, not float32 {shape}"
    return None


def _unusable(path: Path, why: str) -> None:
    """Say, naming the file, why a calibration file is not used (it is then computed again and replaced)."""
    warnings.warn(f"calibration file {path} is not used: {why}; computing it again", stacklevel=3)
    return None


def save_atomic(obj: dict, path: Path) -> None:
    """``torch.save`` into ``path`` through a temporary file, so no reader ever sees half a calibration."""
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
