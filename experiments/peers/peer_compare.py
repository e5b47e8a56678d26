"""Run kvpress (in ``.venv-peers``) and kvcompress on the same token ids and compare: kept-set Jaccard per
(prompt, layer, KV head), summarised per method (mean, min, per layer), and whether greedy answers match."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


def peers_python() -> Path | None:
    """The peers venv's interpreter (``make test-peers`` builds it), or None when it is absent."""
    return PEERS_PYTHON if PEERS_PYTHON.is_file() else None


def start_kvpress(model_dir, prompts, methods, ratio: float, max_new: int, python=None):
    """Start kvpress's side (``kvpress_side.py``, the peers venv) in its own process; ``finish`` reads it."""
    job = {
        "model": str(model_dir), "prompts": prompts, "methods": list(methods),
        "compression_ratio": ratio, "max_new_tokens": max_new,
    }  # fmt: skip
    tmp = tempfile.TemporaryDirectory()
    job_path, out_path = Path(tmp.name) / "job.json", Path(tmp.name) / "out.json"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [str(python or PEERS_PYTHON), str(HERE / "kvpress_side.py"), str(job_path), str(out_path)]
    log = (Path(tmp.name) / "stderr.log").open("w")  # a file, not a pipe: progress bars would fill a pipe
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, tmp, out_path, log


def finish(started) -> dict:
    """kvpress's kept sets and answers from a ``start_kvpress`` process (waits for it)."""
    proc, tmp, out_path, log = started
    with tmp, log:
        proc.wait()
        if proc.returncode != 0:
            err = (Path(tmp.name) / "stderr.log").read_text()
            raise RuntimeError(f"kvpress side failed ({proc.returncode}):\n{err[-4000:]}")
        return json.loads(out_path.read_text())


def run_kvpress(model_dir, prompts, methods, ratio: float, max_new: int, python=None) -> dict:
    """kvpress's kept sets and answers (``start_kvpress`` then ``finish``)."""
    return finish(start_kvpress(model_dir, prompts, methods, ratio, max_new, python))


def jaccard(a, b) -> float:
    """|a & b| / |a | b| of two position sets (1.0 when both are empty)."""
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def compare_method(ours: list[dict], theirs: list[dict]) -> dict:
    """Agreement of one method over its prompts: Jaccard mean / min over every (prompt, layer, KV head), the
    mean per layer, kept counts, and answers equal (token for token) among those kvpress could decode."""
    per_layer: dict[int, list[float]] = {}
    kept_ours = kept_theirs = 0
    for mine, ref in zip(ours, theirs, strict=True):
        for layer, (heads_mine, heads_ref) in enumerate(zip(mine["kept"], ref["kept"], strict=True)):
            for a, b in zip(heads_mine, heads_ref, strict=True):
                per_layer.setdefault(layer, []).append(jaccard(a, b))
                kept_ours, kept_theirs = kept_ours + len(a), kept_theirs + len(b)
    values = [v for vs in per_layer.values() for v in vs]
    decoded = [(mine, ref) for mine, ref in zip(ours, theirs, strict=True) if isinstance(ref["answer"], list)]
    equal = [mine["answer"] == ref["answer"] for mine, ref in decoded]
    return {
        "jaccard_mean": sum(values) / len(values),
        "jaccard_min": min(values),
        "jaccard_per_layer": [sum(vs) / len(vs) for _, vs in sorted(per_layer.items())],
        "kept_ours": kept_ours,
        "kept_kvpress": kept_theirs,
        "answers_equal": sum(equal),
        "prompts": len(ours),
        "answers_compared": len(equal),
        "match_error": max(ref.get("match_error", 0.0) for ref in theirs),
    }


def compare(ours: dict, theirs: dict) -> dict:
    """``compare_method`` for every method both sides ran."""
    return {name: compare_method(ours[name], theirs[name]) for name in ours if name in theirs}
