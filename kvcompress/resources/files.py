"""Files written whole or not at all: a reader never sees half a record, table or task file; and assets
built once by one process while the others wait (``exclusive``)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # no flock on this platform: builds are not serialised
    fcntl = None

__all__ = ["exclusive", "write_json_atomic", "write_text_atomic"]


@contextlib.contextmanager
def exclusive(lock_file: Path, what: str = "", wait_s: float | None = None):
    """Hold ``lock_file``'s ``flock`` for the body: one process at a time builds a shared asset (a fetched
    wheel, an extracted folder, a converted model, a compiled kernel), the others wait and then find it
    built. The operating system releases the lock when its holder dies, so a killed build blocks no one.
    Waits without limit, or at most ``wait_s`` and then raises ``TimeoutError`` naming ``what``."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a+b") as handle:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not _try_flock(handle, blocking=deadline is None):
            if time.monotonic() > deadline:
                held = (
                    f"another process has held the build of {what} in {lock_file.parent} for {wait_s:.0f} s"
                )
                raise TimeoutError(held)
            time.sleep(0.1)
        yield


def _try_flock(handle, blocking: bool) -> bool:
    if fcntl is None:  # no flock on this platform: builds are not serialised
        return True
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


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
