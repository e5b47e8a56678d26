"""Cache files written before the package was laid out by layer (format version 2, unversioned headers,
``tests/data``) load
through the alias table (``kvcompress.persist.aliases``) and equal the same cache built by this code."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvcompress import build_cache, load_cache, save_cache
from kvcompress.core.sources import module_digest
from kvcompress.persist import HEADER_KEY, read_header
from kvcompress.persist.aliases import FIELDS, VERSION, upgrade

DATA = Path(__file__).resolve().parent / "data"
_spec = importlib.util.spec_from_file_location("make_old_caches", DATA / "make_old_caches.py")
old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(old)


def _built(model, name: str):
    """The case as this code builds it: its pre-move field names renamed (``aliases.FIELDS``)."""
    policy, params = old.CASES[name]
    cache = build_cache(policy, model, **_renamed(params))
    with torch.inference_mode():
        model(old.prompt(), cache=cache, use_cache=True)
    return cache


def _next_logits(model, cache) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([[5]]), cache=cache, use_cache=True).logits


@pytest.fixture(scope="module")
def model():
    return old.exact_model()


@pytest.mark.parametrize("name", sorted(old.CASES))
def test_a_file_from_before_the_move_loads_as_the_cache_this_code_builds(model, name):
    """Read through the table, the file names today's modules and fields. While those modules are the code
    of the move (``aliases.AFTER``) it loads as the cache this code builds, bit for bit; once one of them
    has changed since, it is refused naming the module, as any file written by other code is."""
    path = DATA / f"cache_premove_{name}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        raw = json.loads(f.metadata()[HEADER_KEY])
    assert "version" not in raw and "kvcompress.persist_file" in raw["code"]  # really written before the move
    header = upgrade(raw)
    assert header["version"] == VERSION and "kvcompress.persist.file" in header["code"]
    assert all(c.startswith("kvcompress.") and ".policies." not in c for c in _classes(header))
    assert "residual_length" not in json.dumps(header["policy_config"])
    if not _still_the_code_of_the_move(header):
        with pytest.raises(ValueError, match="written by other code: kvcompress"):
            load_cache(path, model)
        return
    loaded, fresh = load_cache(path, model), _built(model, name)
    assert loaded.memory_bytes() == fresh.memory_bytes() > 0
    assert loaded.get_seq_length() == fresh.get_seq_length() == old.prompt().shape[1]
    assert torch.equal(_next_logits(model, loaded), _next_logits(model, fresh))


def _still_the_code_of_the_move(header: dict) -> bool:
    """Whether every module the upgraded ``header`` names has today the digest the table gave it."""
    codes = [header["code"], *(layer["code"] for layer in header["layers"])]
    return all(_digest(module) == digest for code in codes for module, digest in code.items())


def _digest(module: str) -> str | None:
    try:
        return module_digest(module)
    except (ImportError, ValueError):
        return None


def test_a_file_from_before_the_move_of_other_code_is_still_refused(model, tmp_path):
    """The table vouches only for the code of the move: a digest it does not know stays, and is refused."""
    path = DATA / "cache_premove_snapkv_int4.safetensors"
    with safe_open(str(path), framework="pt") as f:
        names = f.keys()
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in names}
    header = json.loads(meta[HEADER_KEY])
    module = next(m for m in header["layers"][0]["code"] if m.endswith("snapkv"))
    header["layers"][0]["code"][module] = "0" * 16
    save_file(tensors, str(tmp_path / "other.safetensors"), metadata={HEADER_KEY: json.dumps(header)})
    unknown = r"kvcompress\.selectors\.eviction\.snapkv \(0{16} in the file"
    if not _still_the_code_of_the_move(upgrade(json.loads(meta[HEADER_KEY]))):
        unknown = "kvcompress"  # the code changed since the move: the file is refused for that first
    with pytest.raises(ValueError, match=rf"written by other code: (.*, )?{unknown}"):
        load_cache(tmp_path / "other.safetensors", model)


def test_a_file_of_an_unknown_version_is_refused_and_new_files_carry_this_one(model, tmp_path):
    cache = _built(model, "tiered")
    save_cache(cache, tmp_path / "now.safetensors")
    assert read_header(tmp_path / "now.safetensors")["version"] == VERSION
    with safe_open(str(tmp_path / "now.safetensors"), framework="pt") as f:
        names = f.keys()
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in names}
    header = {**json.loads(meta[HEADER_KEY]), "version": VERSION + 1}
    save_file(tensors, str(tmp_path / "later.safetensors"), metadata={HEADER_KEY: json.dumps(header)})
    with pytest.raises(
        ValueError, match=rf"format version {VERSION + 1}; this kvcompress reads version {VERSION} "
    ):
        load_cache(tmp_path / "later.safetensors", model)


def _classes(node) -> list[str]:
    if isinstance(node, list):
        return [c for v in node for c in _classes(v)]
    if not isinstance(node, dict):
        return []
    keys = ("class", "store_class", "object", "namedtuple", "_target_")
    own = [v for k, v in node.items() if k in keys and isinstance(v, str)]
    return own + [c for v in node.values() for c in _classes(v)]


def _renamed(params):
    if isinstance(params, dict):
        return {FIELDS.get(k, k): _renamed(v) for k, v in params.items()}
    return params
