"""The GPU first-contact script (``experiments/gpu/smoke.py``) on the CPU at tiny shapes, in bfloat16: the
dry run of what a GPU run records (every cell runs, is refused by name, or says what broke)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "gpu" / "smoke.py"


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
