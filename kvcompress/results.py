"""Results are data: one JSON record per run (config, environment, metrics), written atomically."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

RESULTS_FILE = "results.json"


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


def git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(model=None) -> dict:
    """Versions, commit, device and threads: what is needed to reproduce a number."""
    import transformers

    import kvcompress

    env = {
        "kvcompress": kvcompress.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "threads": torch.get_num_threads(),
    }
    if model is not None:
        env["device"] = str(model.device)
        env["dtype"] = str(model.dtype).removeprefix("torch.")
        if model.device.type == "cuda":
            env["device_name"] = torch.cuda.get_device_name(model.device)
    return env


def load_record(run_dir: Path) -> dict | None:
    path = Path(run_dir) / RESULTS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
