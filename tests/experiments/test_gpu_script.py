"""The GPU first-contact script (``experiments/gpu/smoke.py``) on the CPU at tiny shapes, in bfloat16: the
dry run of what a GPU run records (every cell runs, is refused by name, or says what broke)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "smoke.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bf16_cells_run_or_are_refused_and_full_matches_itself(tmp_path):
    out = tmp_path / "smoke.json"
    shapes = ["--head-dims", "16", "--prefill", "40", "--decode", "4"]
    args = ["--device", "cpu", "--dtypes", "bfloat16", *shapes, "--only", "full,h2o,tiered"]
    _script().main([*args, "--out", str(out)])
    record = json.loads(out.read_text())
    cells = {(c["selector"], c["storage"]): c for c in record["cells"]}
    assert {c["status"] for c in cells.values()} <= {"ok", "refused"}, record["status_counts"]
    ok = [c for c in cells.values() if c["status"] == "ok"]
    assert ok and all(c["finite"] and c["dtype"] == "bfloat16" for c in ok)
    assert cells[("full", "dense")]["first_step_max_abs_vs_full"] == 0.0
    assert cells[("full", "dense")]["backends"] == {"sdpa": 4 * 5}  # 4 layers x (prefill + 4 steps)
    assert cells[("h2o", "dense")]["backends"].get("torch", 0) == 4 * 4  # every decode step scored grouped
    assert "cannot work" in cells[("tiered", "dense")]["error"]  # refused by name, with the fix
    assert cells[("tiered", "offload")]["status"] == "ok"


RUN = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "run.py"


def test_the_gpu_run_dry_runs_every_part_on_the_cpu(tmp_path):
    """``experiments/gpu/run.py --dry-run``: the same code at tiny shapes. Every main policy decodes with no
    host-blocking op per layer-step (``tiered``: at most one), and every cache of the benchmark runs and
    is measured, each compressed one holding fewer bytes than ``full``; transformers' offloading is
    declared CUDA-only rather than run."""
    spec = importlib.util.spec_from_file_location("gpu_run", RUN)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_run"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    out = tmp_path / "run.json"
    module.main(["--dry-run", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["kernels"]["status"] == "skipped" and record["environment"]["dry_run"]
    syncs = record["syncs"]
    assert set(syncs) == set(module.SYNC_POLICIES)
    for name, got in syncs.items():
        assert got["status"] == "ok", (name, got)
        assert got["per_layer_step"] <= (1.0 if name == "tiered" else 0.0), (name, got)
    rows = {(r["context"], r["cache"]): r for r in record["bench"]}
    for n in (64, 128):
        ours = [rows[(n, name)] for name in module.OURS]
        assert all(r["status"] == "ok" and r["decode_tok_s"] > 0 for r in ours), ours
        full = rows[(n, "full")]["cache_bytes"]
        theirs = rows[(n, "DynamicCache")]["cache_bytes"]  # the same tokens; full's buffers grow with spare
        assert theirs <= full <= theirs * (1 + 1 / 64)  # slots (at most 1/128 of them), which it counts
        for name in ("int4", "int2", "snapkv_0.5", "snapkv_0.5_int4"):
            assert rows[(n, name)]["cache_bytes"] < full, name
        assert rows[(n, "DynamicCache_offload")]["status"] == "unavailable"
