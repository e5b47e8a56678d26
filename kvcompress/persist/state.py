"""A cache layer's (or store's) own attributes as a JSON tree plus named tensors, and back.

Used by ``persist`` for cache files: tensors become ``{"tensor": name}`` entries (saved as contiguous
copies), other values stay plain JSON with a marker for their kind, so loading rebuilds tuples, named
tuples, dicts, dtypes and devices exactly. An attribute of an unknown kind is refused by name, so a new
layer attribute that cannot be saved fails loudly (the round-trip test covers every policy and storage).
"""

from __future__ import annotations

import importlib

import torch

# Structure rebuilt by build_cache (policy, shapes, configs), buffer bookkeeping, and transient views;
# rope comes from the model, probe/read_pos are a fidelity probe's (kvcompress.metrics.fidelity), hidden is
# the hidden states a step hands a layer that asked for them (kvzap), consumed within that step;
# decode_evicts, reads_as_stored, observed_probs and order_free are read off the policy when a layer is built.
SKIP = frozenset(
    {
        "policy",
        "spec",
        "store",
        "config",
        "slots",
        "_view",
        "rope",
        "probe",
        "read_pos",
        "_ahead",
        "hidden",
        "decode_evicts",
        "reads_as_stored",
        "observed_probs",
        "order_free",
    }
)
LAZY = frozenset({"device", "dtype"})  # set by a layer's first update (CacheLayerMixin.lazy_initialization)


def state_attributes(obj) -> dict:
    """The attributes of ``obj`` that hold its state (everything but ``SKIP``)."""
    return {k: v for k, v in vars(obj).items() if k not in SKIP}


def encode(value, name: str, tensors: dict, memo: dict | None = None):
    """A JSON-able tree for ``value``; tensors are added to ``tensors`` under names starting with ``name``.

    ``memo`` (id -> name, one per cache) saves a tensor held under two attributes once, so loading gives
    back one shared tensor (plain PCA's encoder is its decoder: counted once in ``memory_bytes()``)."""
    memo = {} if memo is None else memo
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if id(value) in memo:
            return {"tensor": memo[id(value)]}
        tensors[name], memo[id(value)] = value.detach().contiguous().clone(), name
        return {"tensor": name}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        items = [encode(v, f"{name}.{i}", tensors, memo) for i, v in enumerate(value)]
        return {"namedtuple": kind, "items": items}
    if isinstance(value, (list, tuple)):
        key = "list" if isinstance(value, list) else "tuple"
        return {key: [encode(v, f"{name}.{i}", tensors, memo) for i, v in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode(v, f"{name}.{k}", tensors, memo) for k, v in value.items()}}
    from kvcompress.core.storage import Store

    if isinstance(value, Store):  # a store inside a store (keys and values stored apart): its own state
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        state = encode(state_attributes(value), name, tensors, memo)["dict"]
        return {"store": {"class": kind, "state": state}}
    if hasattr(value, "saved_state"):  # an object that says what to save (a cold tier: rows, not its file)
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        return {"object": kind, "state": encode(value.saved_state(), name, tensors, memo)}
    raise TypeError(
        f"cannot save {name}: a {type(value).__name__} (teach kvcompress.persist.state.encode its kind)"
    )


def decode(node, tensors: dict, device):
    """The value ``encode`` described; tensors from ``tensors`` (already on ``device``)."""
    if not isinstance(node, dict):
        return node
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "dtype" in node:
        return getattr(torch, node["dtype"])
    if "device" in node:
        return torch.device(device)
    if "object" in node:
        return _named(node["object"]).from_saved(decode(node["state"], tensors, device))
    if "namedtuple" in node:
        return _named(node["namedtuple"])(*(decode(v, tensors, device) for v in node["items"]))
    if "list" in node:
        return [decode(v, tensors, device) for v in node["list"]]
    if "tuple" in node:
        return tuple(decode(v, tensors, device) for v in node["tuple"])
    return {k: decode(v, tensors, device) for k, v in node["dict"].items()}


def _named(path: str):
    """The class at ``path``, imported only if it is kvcompress's or a registered plugin's (``trusted``)."""
    from kvcompress.core.registry import refuse_untrusted

    refuse_untrusted(path, "load_cache: a saved state")
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def class_names(node) -> set[str]:
    """Every class a state tree (``encode``'s output) names: nested stores, objects and named tuples."""
    if isinstance(node, list):
        return set().union(*map(class_names, node))
    if not isinstance(node, dict):
        return set()
    names = {node[key] for key in ("object", "namedtuple", "class") if isinstance(node.get(key), str)}
    return names.union(*map(class_names, node.values()))
