"""One compressed context, many questions, across processes: cache files (in-process snapshots are
``KVCache.snapshot``, ``kvcompress.core.cache.fork``).

A file is safetensors: every tensor of every layer and store (with a digest of its bytes), plus a JSON
header (``HEADER_KEY``) with the policy (``describe()`` and a ``_target_`` config that rebuilds it), the
model's fingerprint (``calibration.model_fingerprint``), ``get_seq_length`` and each layer's state tree:
the layer's and its store's own attributes, with tensors named, the calibration range its storage read, and
the digests of the code that wrote it. Loading rebuilds the cache with ``build_cache`` (without a
calibration pass: a storage with calibrated bases takes them from the file), puts each layer's tensors on
that layer's device (a model sharded with ``device_map``) and the saved state back, refusing another
model, or a file that is truncated, corrupt, names a class outside kvcompress and its plugins, or was
written by other code (``kvcompress.persist.file``).
"""

from __future__ import annotations

import contextlib
import json

import torch

from kvcompress.core.placement import layer_devices
from kvcompress.core.sources import digests
from kvcompress.persist.file import (
    AGAIN,
    CORE,
    FORMAT,
    HEADER_KEY,
    VERSION,
    check_built,
    check_layer_code,
    check_model,
    layer_code,
    read_header,
    read_tensors,
    tensor_digest,
)
from kvcompress.persist.state import LAZY, decode, encode, state_attributes

__all__ = ["FORMAT", "HEADER_KEY", "cache_state", "load_cache", "read_header", "save"]


def cache_state(cache) -> tuple[list, dict[str, torch.Tensor]]:
    """Every layer's state tree and the tensors it names (copies, contiguous), as ``save`` writes them."""
    tensors: dict[str, torch.Tensor] = {}
    memo: dict[int, str] = {}  # a tensor held twice is saved once and shared again when loaded
    trees = []
    for i, layer in enumerate(cache.layers):
        layer.settle()  # an evicted token is not saved
        trees.append(
            {
                "class": _qualname(layer),
                "store_class": _qualname(layer.store),
                "state": encode(state_attributes(layer), f"layers.{i}", tensors, memo)["dict"],
                "store": encode(state_attributes(layer.store), f"layers.{i}.store", tensors, memo)["dict"],
            }
        )
    return trees, tensors


def save(cache, path, model=None) -> None:
    """Write ``cache`` (built for ``model``, by default the model it was built for) to ``path``: see the
    module docstring for what a file holds."""
    model = model if model is not None else cache.model()
    if model is None:
        raise ValueError("save_cache: the model this cache was built for is gone; pass it as model=")
    from safetensors.torch import save_file

    from kvcompress.persist.config import policy_config
    from kvcompress.storage.low_rank.calibration import model_fingerprint

    trees, tensors = cache_state(cache)
    for layer, tree in zip(cache.layers, trees, strict=True):
        tree["code"] = layer_code(layer, tree)
        tree["calibration_range"] = getattr(layer.store.config, "calibration_range", None)
    tensors = {k: v.cpu() for k, v in tensors.items()}
    header = {
        "format": FORMAT,
        "version": VERSION,
        "code": digests(CORE),
        "policy": cache.policy.describe(),
        "policy_config": policy_config(cache.policy),
        "model_fingerprint": model_fingerprint(model),
        "model_type": model.config.get_text_config(decoder=True).model_type,
        "seq_length": cache.get_seq_length(),
        "tensors": {name: tensor_digest(t) for name, t in tensors.items()},
        "layers": trees,
    }
    save_file(tensors, str(path), metadata={HEADER_KEY: json.dumps(header)})


def load_cache(path, model):
    """The cache saved at ``path``, rebuilt for ``model`` (which must be the model it was saved from)."""
    from kvcompress.persist.config import policy_from_saved

    header = read_header(path)  # readable, this format, trusted class names, this layout code
    check_model(path, header, model)
    check_layer_code(path, header)
    cache = _build(policy_from_saved(header["policy_config"]), model)
    if len(header["layers"]) != len(cache.layers):
        raise ValueError(f"load_cache: {path}: format mismatch: {len(header['layers'])} layers saved, model "
                         f"has {len(cache.layers)}")  # fmt: skip
    for i, (layer, saved) in enumerate(zip(cache.layers, header["layers"], strict=True)):
        check_built(path, i, saved, layer)
    devices = layer_devices(model, len(cache.layers))
    tensors = read_tensors(path, header, devices)
    for i, (layer, saved) in enumerate(zip(cache.layers, header["layers"], strict=True)):
        where = f"{path}: layer {i}"
        _restore(layer, saved["class"], saved["state"], where, tensors[i], devices[i])
        _restore(layer.store, saved["store_class"], saved["store"], f"{where} store", tensors[i], devices[i])
        if hasattr(layer.store.config, "calibration_from_file"):
            layer.store.config.calibration_from_file(saved.get("calibration_range"))
    if cache.get_seq_length() != header["seq_length"]:
        raise ValueError(f"load_cache: {path}: state did not restore: seq_length {cache.get_seq_length()}, "
                         f"the file has {header['seq_length']}")  # fmt: skip
    return cache


def _build(policy, model):
    """``build_cache(policy, model)`` without a calibration pass: every storage that can take its
    calibrated constants from the file (``bases_from_file``) builds its layers with placeholders, which
    ``_restore`` then replaces by the saved ones."""
    from kvcompress.core.cache import build_cache, model_spec

    policy.check(model_spec(model))  # a schedule resolves (and keeps) the storage of every layer
    with contextlib.ExitStack() as stack:
        for storage in _storages(policy):
            if hasattr(storage, "bases_from_file"):
                stack.enter_context(storage.bases_from_file())
        return build_cache(policy, model)


def _storages(obj, seen: set | None = None):
    """Every ``Storage`` reachable from a policy: its fields, nested storages, and the per-layer policies a
    schedule resolved (what ``prepare`` reaches)."""
    from kvcompress.core.policy import Policy
    from kvcompress.core.storage import Storage

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Storage):
        yield obj
    if isinstance(obj, (Policy, Storage)):
        obj = vars(obj)
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _storages(value, seen)


def _restore(obj, cls: str, state: dict, where: str, tensors, device) -> None:
    """Put a saved state tree back into a freshly built ``obj``, after checking it is the same format."""
    if _qualname(obj) != cls:
        raise ValueError(f"load_cache: format mismatch: {where} was saved as {cls}, the code builds "
                         f"{_qualname(obj)}")  # fmt: skip
    have = set(state_attributes(obj))
    if set(state) - LAZY != have - LAZY:
        raise ValueError(
            f"load_cache: format mismatch: {where} ({cls}) attributes differ from this code's: saved only "
            f"{sorted(set(state) - have)}, missing {sorted(have - set(state))}; {AGAIN}"
        )
    for name, node in state.items():
        if isinstance(node, dict) and "store" in node:  # a nested store: restored in place, same checks
            _restore(getattr(obj, name), node["store"]["class"], node["store"]["state"], f"{where}.{name}",
                     tensors, device)  # fmt: skip
            continue
        setattr(obj, name, decode(node, tensors, device))
    if hasattr(obj, "loaded"):  # a store: rebuild what a file does not keep (kernel layouts)
        obj.loaded()


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
