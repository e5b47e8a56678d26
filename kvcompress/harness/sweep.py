"""Sweeps that resume and report: skip runs already done, collect a finished multirun into tables/plots.

``kvcompress -m ...`` writes each run to ``multirun/<sweep_name>/<overrides>/results.json``: the folder
depends only on the sweep name and the run's overrides, so the same command started again finds every
record. A record counts as done when its status is ``ok``, its config equals the new run's config and
(with the default ``resume=true``) it was written by the same code version (``results.code_version``: the git
commit and uncommitted changes in a checkout, the hash of the package's files in an installed package).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kvcompress.core.registry import with_declared
from kvcompress.harness.results import code_version, load_record

# Keys that do not change what a run measures: a resumed sweep may log elsewhere or be renamed.
IGNORED_KEYS = ("logger", "resume", "sweep_name")


def run_dirname(overrides: str, max_len: int = 120) -> str:
    """Folder name of a sweep run from Hydra's ``override_dirname``: ``/`` made safe, long names hashed."""
    name = overrides.replace("/", "_") or "default"
    if len(name) > max_len:
        name = name[: max_len - 9] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def _comparable(config: dict) -> dict:
    """``config`` as a record compares: after a JSON round trip (what results.json holds), without
    ``IGNORED_KEYS``, and with the fields its policy and storage lack at their declared defaults (a record
    written before a field existed, or before the config listed it, stands at that default)."""
    plain = json.loads(json.dumps(config, default=str))
    for group in ("policy", "storage"):
        if isinstance(plain.get(group), dict) and "_target_" in plain[group]:
            plain[group] = with_declared(plain[group])
    return {k: v for k, v in plain.items() if k not in IGNORED_KEYS}


RESUME_MODES = {
    "true": "reuse ok records of the same config and code version (default)",
    "false": "always rerun",
    "any": "reuse ok records of the same config, even from other code versions",
}


def resume_mode(value) -> str:
    """``resume`` as one of ``RESUME_MODES`` (YAML/CLI give booleans for true/false); errors name them."""
    mode = str(value).lower() if isinstance(value, (bool, str)) else None
    if mode not in RESUME_MODES:
        allowed = "; ".join(f"{k}: {v}" for k, v in RESUME_MODES.items())
        raise ValueError(f"resume={value!r} is not allowed; allowed values: {allowed}")
    return mode


def _version_mismatch(recorded, current) -> str | None:
    """Why a record of code version ``recorded`` may not stand for ``current``, or None if it may.

    Both from a git checkout: the same commit and uncommitted changes (and the same files, when both hashed
    them). Otherwise (an installed package) the same hash of the package's files: a record of the same code
    is reused whether a checkout, a wheel or a copy wrote it."""
    current, recorded = current or {}, recorded or {}
    if current.get("commit") and recorded.get("commit"):
        keys = ["commit", "dirty_hash"] + (["files_hash"] if recorded.get("files_hash") else [])
    elif current.get("files_hash") and recorded.get("files_hash"):
        keys = ["files_hash"]
    elif not current.get("commit") and not current.get("files_hash"):
        return "the current code version is unknown (no git checkout and no package files to hash)"
    else:
        return "the record carries no code version it can be compared on (written by older kvcompress)"
    if any(recorded.get(k) != current.get(k) for k in keys):
        shown = {k: recorded.get(k) for k in ("version", *keys)}
        now = {k: current.get(k) for k in ("version", *keys)}
        return f"it was written by code version {shown}, the code is now {now}"
    return None


def completed_record(out_dir: Path, config: dict, resume=True, version: dict | None = None) -> dict | None:
    """The ``ok`` record in ``out_dir`` if ``resume`` allows reusing it for ``config``, else None (run it).

    Args:
        resume: ``true`` (same config and code version), ``false`` (never reuse) or ``any`` (same config).
        version: the current ``code_version()`` (computed when None), compared with the record's.
    """
    mode = resume_mode(resume)
    record = load_record(out_dir) if mode != "false" else None
    if record is None or record.get("status") != "ok":
        return None
    if _comparable(record.get("config", {})) != _comparable(config):
        print(f"[kvcompress] {out_dir}: config changed since the recorded run; running it again")
        return None
    why = _version_mismatch(record.get("code_version"), version or code_version())
    if why and mode == "true":
        print(f"[kvcompress] {out_dir}: ok record not reused: {why}; running it again (resume=any reuses it)")
        return None
    if why:
        print(f"[kvcompress] {out_dir}: resume=any reuses the ok record although {why}")
    return record


def running_process() -> dict:
    """Where a run is going: its host and process id, kept in its record while it runs."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def running_elsewhere(record: dict) -> bool:
    """Whether ``record`` is a run still going in another live process on this host (a second sweep over
    the same folder), rather than one that failed or was killed. A record of another host, or one written
    before records named their process, cannot be checked here and counts as unfinished."""
    process = record.get("process") or {}
    pid = process.get("pid")
    return (
        record.get("status") == "running"
        and process.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and pid != os.getpid()
        and _alive(pid)
    )


def unfinished(records: list[dict]) -> tuple[list[str], list[str]]:
    """The run folders of ``records`` that did not finish ok: (failed or killed, still running elsewhere)."""
    bad = [r for r in records if r.get("status") != "ok"]
    elsewhere = [r["run_dir"] for r in bad if running_elsewhere(r)]
    return [r["run_dir"] for r in bad if r["run_dir"] not in elsewhere], elsewhere


class CollectCallback(Callback):
    """Hydra callback: at the end of a multirun, one table + plots from the sweep's records.

    Exits with status 1 after collecting if any run failed or was killed (Hydra turns callback exceptions
    into warnings, so the exit is explicit). A run another live process is still writing into the same sweep
    folder (two sweeps sharing it) is listed, and does not fail this one.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from kvcompress.harness.loggers import make_logger
        from kvcompress.harness.summary import summarize

        sweep_dir = Path(config.hydra.sweep.dir)
        summary = summarize(sweep_dir)
        if summary is None:
            return
        print(summary["markdown"])
        print("[kvcompress] wrote " + ", ".join(str(p) for p in summary["files"]))
        make_logger(config.get("logger")).log_sweep(summary, sweep_dir)
        failed, elsewhere = unfinished(summary["records"])
        if elsewhere:
            print(f"[kvcompress] {len(elsewhere)} run(s) still running in another process:", file=sys.stderr)
            print("\n".join(elsewhere), file=sys.stderr)
        if failed:
            print(f"[kvcompress] {len(failed)} run(s) did not finish ok (see results.json):", file=sys.stderr)
            print("\n".join(failed), file=sys.stderr)
            raise SystemExit(1)
