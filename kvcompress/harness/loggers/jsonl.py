"""``logger=jsonl``: append one JSON line per run (and per finished sweep) to a local file."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from kvcompress.harness.loggers import Logger


class JsonlLogger(Logger):
    """Appends records to ``path``; a lock keeps lines whole when parallel runs (joblib) share the file."""

    def __init__(self, path: str = "logs/kvcompress.jsonl"):
        self.path = Path(path)

    def _append(self, entry: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(entry, default=str) + "\n"
        with self.path.open("a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.write(line)
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def log_run(self, record: dict, out_dir) -> None:
        entry = {k: v for k, v in record.items() if k != "traceback"}
        self._append({"kind": "run", "out_dir": str(out_dir), **entry})

    def log_sweep(self, summary: dict, sweep_dir) -> None:
        files = [str(p) for p in summary["files"]]
        self._append({"kind": "sweep", "sweep_dir": str(sweep_dir), "rows": summary["rows"], "files": files})
