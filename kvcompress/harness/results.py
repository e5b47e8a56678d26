"""Results are data: one JSON record per run (config, environment, metrics), written atomically."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from kvcompress.metrics.perplexity_interval import current_perplexity

RESULTS_FILE = "results.json"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the repository root in a source checkout
# What committed records' configs spell otherwise today (``current_record``): the package of a ``_target_``
# before the move, and each policy or storage field renamed since, with its values that changed too.
MOVED = ("kvcompress.policies.", "kvcompress.selectors.")
RENAMED = {
    "residual_length": ("recent", {}),
    "fused_attention": (
        "backend",
        {"kernel": "cpu", "compile": "torch", "eager": "torch", "on": "torch", "off": "dense"},
    ),
}


def _git(root: Path, *args: str) -> str | None:
    """Output of ``git -C root args``, or None when git is missing, fails or times out."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _repo_root(root: Path) -> Path | None:
    """``root`` when it is the top of a git work tree (not a folder inside some other repository)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    return root if top and Path(top.strip()).resolve() == root.resolve() else None


def git_commit(root: Path = PACKAGE_ROOT) -> str | None:
    """The commit checked out in kvcompress's own repository, or None (no git, installed wheel)."""
    if _repo_root(root) is None:
        return None
    return (_git(root, "rev-parse", "HEAD") or "").strip() or None


def _dirty_hash(root: Path, package: str) -> str | None:
    """Short hash of the uncommitted changes under ``package/`` (diff + untracked files), None if clean."""
    diff = _git(root, "diff", "HEAD", "--", package) or ""
    untracked = (_git(root, "ls-files", "--others", "--exclude-standard", "--", package) or "").split()
    digest = hashlib.sha256(diff.encode())
    for name in sorted(untracked):  # a new module changes behaviour as much as an edited one
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    return digest.hexdigest()[:12] if diff or untracked else None


SOURCE_SUFFIXES = (".py", ".yaml", ".cpp", ".h")  # what the package's behaviour is made of


def files_hash(package_dir: Path) -> str | None:
    """Short content hash of the package's own source files (``SOURCE_SUFFIXES``, sorted by relative path;
    caches and built objects left out): equal for the same code in a checkout, a wheel or a copy."""
    files = sorted(p for p in Path(package_dir).rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file())
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(package_dir).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def installed_version(package: str = "kvcompress") -> str | None:
    """The version of ``package`` its installation declares (``importlib.metadata``), or None."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def code_version(root: Path = PACKAGE_ROOT, package: str = "kvcompress") -> dict:
    """The code that produced a record: ``{"commit", "dirty_hash", "version", "files_hash"}``.

    ``commit`` and ``dirty_hash`` (a short hash of the uncommitted diff and untracked files of ``package/``,
    None when clean) come from git and are None without a checkout (an installed wheel). ``version`` is the
    installed package's version and ``files_hash`` the content hash of ``root/package``'s source files
    (``files_hash``): an installed package knows its code too, and ``resume`` compares it
    (``sweep._version_mismatch``).
    """
    commit = git_commit(root)
    return {
        "commit": commit,
        "dirty_hash": _dirty_hash(root, package) if commit else None,
        "version": installed_version(package),
        "files_hash": files_hash(Path(root) / package),
    }


def machine() -> dict:
    """The hardware a number came from: CPU model, logical cores and memory (no host name)."""
    info = {"processor": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or None
    try:
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        info["memory_bytes"] = None
    return info


def command_line(argv: list[str] | None = None, overrides: list[str] | None = None) -> str:
    """The one command that reruns this record: ``kvcompress`` with the run's own overrides when Hydra
    gave them (in a sweep, this run's point, not the whole sweep), else the process's arguments."""
    import shlex

    args = overrides if overrides is not None else list(sys.argv[1:] if argv is None else argv)
    return " ".join(["kvcompress", *(shlex.quote(a) for a in args)])


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
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "machine": machine(),
    }
    if model is not None:
        env["device"] = str(model.device)
        env["dtype"] = str(model.dtype).removeprefix("torch.")
        if model.device.type == "cuda":
            env["device_name"] = torch.cuda.get_device_name(model.device)
    return env


def current_names(node):
    """A recorded policy or storage config (any part of one) as today's code spells it: each ``_target_``
    after the package move (``MOVED``) and each field renamed since, its value mapped too (``RENAMED``)."""
    if isinstance(node, list):
        return [current_names(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "_target_" and isinstance(value, str) and value.startswith(MOVED[0]):
            value = MOVED[1] + value.removeprefix(MOVED[0])
        elif key in RENAMED:
            key, values = RENAMED[key]
            value = values.get(value, value) if isinstance(value, str) else value
        out[key] = current_names(value)
    return out


def current_record(record: dict) -> dict:
    """A record read back (resume, tables) with its policy and storage configs under today's names
    (``current_names``) and its perplexity interval by today's method
    (``metrics.perplexity_interval.current_perplexity``): a record written before a rename or a change of
    method reads as one written after it, and committed records are never rewritten."""
    if isinstance(record.get("metrics"), dict):
        record = {**record, "metrics": current_perplexity(record["metrics"])}
    config = record.get("config")
    if not isinstance(config, dict):
        return record
    fixed = {k: current_names(v) if k in ("policy", "storage") else v for k, v in config.items()}
    return {**record, "config": fixed}


def load_record(run_dir: Path) -> dict | None:
    """The record in ``run_dir`` (``current_record``), or None when there is none or it is not JSON."""
    path = Path(run_dir) / RESULTS_FILE
    if not path.is_file():
        return None
    try:
        return current_record(json.loads(path.read_text()))
    except json.JSONDecodeError:
        return None
