"""Reproducibility: the same config run twice in one environment gives identical metrics (speed aside),
and every record says what produced it (versions, commit, device, threads, dtype, seed)."""

from __future__ import annotations

import pytest
from helpers import run_config

from kvcompress.harness.app import run_experiment

CASES = {
    "full": ["policy=full"],
    "h2o": ["policy=h2o", "policy.budget=20", "policy.compression_ratio=null", "policy.recent=4"],
    "quant": ["policy=quant", "policy.bits=2", "policy.group_size=4", "policy.recent=8"],
    "low_rank": ["policy=low_rank", "policy.rank=4", "policy.calibration_text=random", "policy.energy=null"],
}


def _timeless(metrics: dict) -> dict:
    """Metrics without wall-clock fields (``*_s``, ``*tok_s``, RSS)."""
    return {k: v for k, v in metrics.items() if not (k.endswith("_s") or "rss" in k or "per_s" in k)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_config_twice_gives_identical_metrics(case, tmp_path, tiny_checkpoint, fake_cache):
    from helpers import fake_essay

    (tmp_path / "essays.txt").write_text(" ".join(fake_essay(i) for i in range(3)))
    extra = [f"policy.calibration_dir={tmp_path / 'calib'}"] if case == "low_rank" else []
    cfg = run_config(tiny_checkpoint, tmp_path, *CASES[case], *extra, "resume=false")
    first = run_experiment(cfg, tmp_path / "a")
    if case == "low_rank":  # the second run must recompute, not reuse the saved calibration
        for f in (tmp_path / "calib").glob("*"):
            f.unlink()
    second = run_experiment(cfg, tmp_path / "b")
    assert first["status"] == second["status"] == "ok"
    a, b = _timeless(first["metrics"]), _timeless(second["metrics"])
    assert a == b
    assert a["perplexity"] > 1.0
    env = first["environment"]
    for field in ("torch", "transformers", "kvcompress", "device", "threads", "dtype"):
        assert env.get(field) not in (None, ""), f"environment.{field} missing: {env}"
    assert first["config"]["seed"] == 0
