"""Reading a cache file safely: its header checked, its classes trusted, its tensors whole and on the right
device, its format the one this code writes.

A file is refused with an error that names it and what is wrong: not a safetensors file or truncated; a
header that is not kvcompress's JSON; a class outside kvcompress and the registered plugins (refused before
anything is imported, ``registry.trusted``); a tensor missing, or whose bytes differ from the digest saved
with it (corrupt); of a format version other than ``VERSION`` (``OLD_VERSIONS``: a file of an older layout
is refused by its version, never translated); or written by other code.
The version of the format is the code that wrote it (``kvcompress.core.sources``): the header holds the
digests of ``CORE`` and, per layer, of every module defining the layer's, its store's and their configs'
classes and their bases (nested stores and saved objects too).
A module whose source differs, or one this code's layer is built from that the file does not list, means
the state may be laid out differently: save the cache again with this code. Each layer's tensors go to the
device its attention runs on (``kvcompress.core.placement``).
"""

from __future__ import annotations

import hashlib
import json

import torch

from kvcompress.core.registry import refuse_untrusted
from kvcompress.core.sources import class_modules, digests, module_digest
from kvcompress.persist.state import class_names

FORMAT = "kvcompress-cache"
HEADER_KEY = "kvcompress"
CORE = (
    "kvcompress.persist",
    "kvcompress.persist.file",
    "kvcompress.persist.state",
)  # the header and state layout
KEYS = ("format", "code", "policy_config", "model_fingerprint", "seq_length", "tensors", "layers")
AGAIN = "save the cache again with this code"
VERSION = 3  # the header's layout; a header without "version" is version 2
OLD_VERSIONS = {  # version -> what it was, and the last commit that wrote (and so could read) it
    1: ("headers without code digests", "0a79127"),
    2: ("headers without a version, before the package move", "fa1acd7"),
}


def tensor_digest(t: torch.Tensor) -> str:
    """First 16 hex digits of the sha256 of a CPU tensor's bytes (a truncated or corrupted file shows)."""
    flat = t.clone(memory_format=torch.contiguous_format).reshape(-1)  # a 1-element view may keep a stride
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def layer_code(layer, tree: dict) -> dict[str, str]:
    """``{module: digest}`` of the modules whose code made ``layer``'s saved ``tree``."""
    return digests(built_modules(layer) | class_modules(*map(_saved_class, class_names(tree))))


def built_modules(layer) -> set[str]:
    """Modules defining a built layer's classes: the layer, its policy, its store and the store's config."""
    return class_modules(type(layer), type(layer.policy), type(layer.store), type(layer.store.config))


def read_header(path) -> dict:
    """The header of the cache file at ``path``, after checking it is one this code can read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise
    except Exception as err:  # safetensors raises its own error type for every malformed file
        raise ValueError(f"load_cache: {path} is truncated or not a safetensors file ({err})") from err
    if HEADER_KEY not in meta:
        raise ValueError(f"load_cache: {path} is not a kvcompress cache file (no {HEADER_KEY!r} header)")
    try:
        header = json.loads(meta[HEADER_KEY])
    except json.JSONDecodeError as err:
        raise ValueError(
            f"load_cache: {path} is corrupt: its {HEADER_KEY!r} header is not JSON ({err})"
        ) from err
    _check_header(path, header)
    return header


def _check_header(path, header) -> None:
    """The format, the keys this code reads, the code of the layout itself, and only trusted class names."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"load_cache: {path} is not a kvcompress cache file (format is not {FORMAT!r})")
    _check_version(path, header.get("version", 2))
    missing = [key for key in KEYS if key not in header]
    if not missing and not all(isinstance(layer, dict) for layer in header["layers"]):
        raise ValueError(f"load_cache: {path} is corrupt: its header's layers are not state trees")
    if missing:
        raise ValueError(f"load_cache: {path} lacks {missing}: written by another kvcompress; {AGAIN}")
    for i, layer in enumerate(header["layers"]):
        names = [layer.get("class"), layer.get("store_class"), *class_names(layer), *layer.get("code", {})]
        for name in names:
            refuse_untrusted(name, f"load_cache: {path} (layer {i})")
    _check_code(path, "the file's layout", header["code"], set(CORE))


def _check_version(path, version) -> None:
    """Refuse a header layout other than ``VERSION``, naming both and, for an older one, the last commit
    that wrote it."""
    if version == VERSION:
        return
    known = isinstance(version, int) and version in OLD_VERSIONS
    what, commit = OLD_VERSIONS[version] if known else ("unknown to this kvcompress", None)
    last = f", last written by kvcompress commit {commit}" if commit else ""
    raise ValueError(
        f"load_cache: {path} is cache file format version {version!r} ({what}{last}); this kvcompress "
        f"reads format version {VERSION} only: save it again with this code"
    )


def check_model(path, header: dict, model) -> None:
    """Refuse a file saved from another model (``calibration.model_fingerprint``), naming both."""
    from kvcompress.storage.low_rank.calibration import model_fingerprint

    mine = model_fingerprint(model)
    if header["model_fingerprint"] != mine:
        raise ValueError(
            f"load_cache: model mismatch: {path} was saved from a {header.get('model_type')!r} model with "
            f"fingerprint {str(header['model_fingerprint'])[:12]}..., this is a "
            f"{model.config.get_text_config(decoder=True).model_type!r} model with fingerprint {mine[:12]}..."
        )


def check_layer_code(path, header: dict) -> None:
    """Refuse the file if any layer was written by code whose modules' sources differ from this code's
    (checked before the policy is built from the file, which other code may not even build)."""
    for i, saved in enumerate(header["layers"]):
        _check_code(path, _layer_name(i, saved), saved.get("code"), set())


def check_built(path, i: int, saved: dict, layer) -> None:
    """Refuse layer ``i`` of the file if this code builds ``layer`` from a module the file does not list
    (a class hierarchy that changed)."""
    _check_code(path, _layer_name(i, saved), saved.get("code"), built_modules(layer))


def _layer_name(i: int, saved: dict) -> str:
    return f"layer {i} ({saved.get('class')} over {saved.get('store_class')})"


def _check_code(path, where: str, saved, needed: set[str]) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"load_cache: {path}: {where} records no code digests; {AGAIN}")
    changed = []
    for name, value in sorted(saved.items()):
        now = _digest_or_none(name)
        if now != value:
            changed.append(f"{name} ({value} in the file, {now or 'no such module'} here)")
    changed += [f"{name} (not in the file)" for name in sorted(needed - set(saved))]
    if changed:
        raise ValueError(
            f"load_cache: {path}: {where} was written by other code: {', '.join(changed)} differ; {AGAIN}"
        )


def read_tensors(path, header: dict, devices: list) -> list[dict[str, torch.Tensor]]:
    """Per layer the tensors its state names, each checked against its digest and put on that layer's
    device (``devices``); a tensor two layers share on one device stays one tensor."""
    from safetensors import safe_open

    sums, out, moved = header["tensors"], [], {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        present = set(f.keys())
        for i, (tree, device) in enumerate(zip(header["layers"], devices, strict=True)):
            mine = {}
            for name in sorted(_tensor_names([tree.get("state"), tree.get("store")])):
                if (name, device) not in moved:
                    moved[name, device] = _read_one(f, path, i, name, present, sums).to(device)
                mine[name] = moved[name, device]
            out.append(mine)
    return out


def _read_one(f, path, i: int, name: str, present: set, sums: dict) -> torch.Tensor:
    if name not in present:
        raise ValueError(f"load_cache: {path} is corrupt: layer {i} names tensor {name!r}, which it lacks")
    try:
        t = f.get_tensor(name)
    except Exception as err:  # safetensors' own error type
        raise ValueError(f"load_cache: {path} is truncated or corrupt: tensor {name!r}: {err}") from err
    if tensor_digest(t) != sums.get(name):
        raise ValueError(
            f"load_cache: {path} is corrupt: tensor {name!r} of layer {i} differs from its digest"
        )
    return t


def _tensor_names(node) -> set[str]:
    if isinstance(node, list):
        return set().union(*map(_tensor_names, node))
    if not isinstance(node, dict):
        return set()
    if isinstance(node.get("tensor"), str):
        return {node["tensor"]}
    return set().union(*map(_tensor_names, node.values()))


def _digest_or_none(name: str) -> str | None:
    try:
        return module_digest(name)
    except (ImportError, ValueError, OSError):
        return None


def _saved_class(path: str) -> type:
    """A class named in a state tree being saved (already imported: its instance is being saved)."""
    import importlib

    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)
