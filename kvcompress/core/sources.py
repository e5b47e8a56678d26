"""Digests of the source files of kvcompress modules: the version of a saved file is the code that wrote it.

A cache file (``kvcompress.persist``) and a calibration (``kvcompress.storage.low_rank.calibration``) record
the digest of
every module whose code shapes what they store; a reader whose code differs refuses the file (or computes it
again) instead of trusting a hand-bumped version number that nobody bumped.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from pathlib import Path


@functools.cache
def module_digest(name: str) -> str:
    """The first 16 hex digits of the sha256 of module ``name``'s source file, read once per process (the
    code this process runs, even if the file is edited later). The module must already be trusted: it is
    imported if it is not yet."""
    module = importlib.import_module(name)
    path = getattr(module, "__file__", None)
    if path is None:
        raise ValueError(f"module {name!r} has no source file to take a digest of")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def digests(names) -> dict[str, str]:
    """``{module: digest}`` for every module in ``names``, sorted by name."""
    return {name: module_digest(name) for name in sorted(set(names))}


def digest(names) -> str:
    """One digest over the modules in ``names`` (their names and sources)."""
    text = ";".join(f"{name}={value}" for name, value in digests(names).items())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def class_modules(*classes) -> set[str]:
    """The modules that define ``classes`` and every base class in their MROs, kvcompress's own and a
    plugin's (``registry.trusted``): what their instances do and hold is written there."""
    from kvcompress.core.registry import trusted

    return {c.__module__ for cls in classes for c in cls.__mro__ if trusted(c.__module__)}
