"""Files written whole or not at all: a reader never sees half a record, table or task file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["write_json_atomic", "write_text_atomic"]


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file + rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` atomically (see ``write_text_atomic``)."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str))
