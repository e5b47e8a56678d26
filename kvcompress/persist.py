"""One compressed context, many questions: exact cache copies (snapshots) and cache files.

A snapshot is a deep copy of the layers that shares only what never changes (the policy, the model
spec, storage configs and per-layer constants such as a low-rank basis), so restoring it gives back the
identical compressed state: no byte of a later question or answer survives.

A file is safetensors: every tensor of every layer and store, plus a JSON header (``HEADER_KEY``) with the
format version, the policy (``describe()`` and a ``_target_`` config that rebuilds it), the model's
fingerprint (``calibration.model_fingerprint``), ``get_seq_length`` and each layer's state tree: the
layer's and its store's own attributes, with tensors named. Loading rebuilds the cache with
``build_cache`` and puts the saved state back, refusing another model, another format version, or state
whose classes or attributes differ from what the code builds now (a code change that altered the format).
"""

from __future__ import annotations

import copy
import json

import torch

from kvcompress.state import LAZY, decode, encode, state_attributes

FORMAT = "kvcompress-cache"
VERSION = 1
HEADER_KEY = "kvcompress"


def fork(cache):
    """A deep copy of ``cache`` sharing the constants of its layers (see module docstring)."""
    memo = {}
    for layer in cache.layers:
        layer.settle()  # a pending eviction is carried out, not copied
        for shared in (layer.policy, layer.spec, layer.store.config, *layer.store.fixed_tensors()):
            memo[id(shared)] = shared
    new = copy.copy(cache)
    with torch.inference_mode():  # caches are filled under inference mode: copy them there too
        new.layers = copy.deepcopy(cache.layers, memo)
    for layer in new.layers:  # copied buffers were not allocated by the copy's slots
        layer.slots.clear()
        if hasattr(layer.store, "slots"):
            layer.store.slots.clear()
    return new


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


def save(cache, path, model) -> None:
    from safetensors.torch import save_file

    from kvcompress.calibration import model_fingerprint
    from kvcompress.policies.config import policy_config

    trees, tensors = cache_state(cache)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "policy": cache.policy.describe(),
        "policy_config": policy_config(cache.policy),
        "model_fingerprint": model_fingerprint(model),
        "model_type": model.config.get_text_config(decoder=True).model_type,
        "seq_length": cache.get_seq_length(),
        "layers": trees,
    }
    save_file({k: v.cpu() for k, v in tensors.items()}, str(path), metadata={HEADER_KEY: json.dumps(header)})


def read_header(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if HEADER_KEY not in meta:
        raise ValueError(f"load_cache: {path} is not a kvcompress cache file (no {HEADER_KEY!r} header)")
    return json.loads(meta[HEADER_KEY])


def load_cache(path, model):
    """The cache saved at ``path``, rebuilt for ``model`` (which must be the model it was saved from)."""
    from safetensors.torch import load_file

    from kvcompress.cache import build_cache
    from kvcompress.calibration import model_fingerprint
    from kvcompress.policies.config import policy_from_saved

    header = read_header(path)
    _check(header, "format", FORMAT, "this is not a kvcompress cache file")
    _check(header, "version", VERSION, "the cache file format changed; save the cache again with this code")
    mine = model_fingerprint(model)
    if header.get("model_fingerprint") != mine:
        raise ValueError(
            f"load_cache: model mismatch: {path} was saved from a {header.get('model_type')!r} model with "
            f"fingerprint {str(header.get('model_fingerprint'))[:12]}..., this is a "
            f"{model.config.get_text_config(decoder=True).model_type!r} model with fingerprint {mine[:12]}..."
        )
    cache = build_cache(policy_from_saved(header["policy_config"]), model)
    tensors = load_file(str(path), device=str(model.device))
    if len(header["layers"]) != len(cache.layers):
        raise ValueError(f"load_cache: format mismatch: {len(header['layers'])} layers saved, model has "
                         f"{len(cache.layers)}")  # fmt: skip
    for i, (layer, saved) in enumerate(zip(cache.layers, header["layers"], strict=True)):
        _restore(layer, saved["class"], saved["state"], f"layer {i}", tensors, model.device)
        _restore(layer.store, saved["store_class"], saved["store"], f"layer {i} store", tensors, model.device)
    _check(
        {"seq_length": cache.get_seq_length()}, "seq_length", header["seq_length"], "state did not restore"
    )
    return cache


def _restore(obj, cls: str, state: dict, where: str, tensors, device) -> None:
    """Put a saved state tree back into a freshly built ``obj``, after checking it is the same format."""
    if _qualname(obj) != cls:
        raise ValueError(f"load_cache: format mismatch: {where} was saved as {cls}, the code builds "
                         f"{_qualname(obj)}")  # fmt: skip
    have = set(state_attributes(obj))
    if set(state) - LAZY != have - LAZY:
        raise ValueError(
            f"load_cache: format mismatch: {where} ({cls}) attributes differ from this code's: saved only "
            f"{sorted(set(state) - have)}, missing {sorted(have - set(state))}; save the cache again"
        )
    for name, node in state.items():
        if isinstance(node, dict) and "store" in node:  # a nested store: restored in place, same checks
            _restore(getattr(obj, name), node["store"]["class"], node["store"]["state"], f"{where}.{name}",
                     tensors, device)  # fmt: skip
            continue
        setattr(obj, name, decode(node, tensors, device))
    if hasattr(obj, "loaded"):  # a store: rebuild what a file does not keep (kernel layouts)
        obj.loaded()


def _check(header: dict, key: str, want, hint: str) -> None:
    if header.get(key) != want:
        raise ValueError(
            f"load_cache: {key} mismatch: file has {header.get(key)!r}, expected {want!r} ({hint})"
        )


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
