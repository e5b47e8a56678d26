"""`sweep=frontier`: Optuna's multi-objective search over selector x ratio x storage bits returns the Pareto
set of the trials it ran, each trial a record like any sweep's; the objectives a run hands back."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from test_sweep import _env

from kvcompress.harness.cli import objectives
from kvcompress.harness.report import collect

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
TRIALS = 6


def _dominates(a: tuple, b: tuple) -> bool:
    """Both objectives minimised: ``a`` is no worse on either and better on one."""
    return all(x <= y for x, y in zip(a, b, strict=True)) and a != b


@pytest.mark.slow
def test_frontier_returns_the_non_dominated_trials(tmp_path, tiny_checkpoint):
    cmd = [
        sys.executable, "-m", "kvcompress", "-m", "sweep=frontier", "model=hf",
        f"model.name={tiny_checkpoint}",
        "task=perplexity", "task.max_tokens=64", "task.slices=1", "task.speed=false",
        "storage.group_size=16", "storage.recent=8",  # the tiny model's head_dim is 16
        "objectives=[perplexity,cache_ratio]", "hydra.sweeper.direction=[minimize,minimize]",
        f"hydra.sweeper.n_trials={TRIALS}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "multirun" / "frontier"
    records = [r for r in collect(sweep) if r["status"] == "ok"]
    assert len(records) == TRIALS  # one record per trial, as in any sweep

    def key(params: dict) -> tuple:
        return (
            params["policy"],
            round(float(params["policy.compression_ratio"]), 9),
            int(params["storage.bits"]),
        )

    trials = {}
    for r in records:
        cfg = r["config"]
        params = {"policy": r["policy_name"], "policy.compression_ratio": cfg["policy"]["compression_ratio"],
                  "storage.bits": cfg["storage"]["bits"]}  # fmt: skip
        trials[key(params)] = (r["metrics"]["perplexity"], r["metrics"]["cache_ratio"])
    assert len(trials) == TRIALS  # distinct points (a continuous ratio is never drawn twice)
    solutions = yaml.safe_load((sweep / "optimization_results.yaml").read_text())["solutions"]
    front = {key(s["params"]): tuple(s["values"]) for s in solutions}
    assert front and all(trials[k] == pytest.approx(v) for k, v in front.items())  # values are the records'
    for k, values in front.items():  # nothing the search ran beats a point of the set on both objectives
        assert not any(_dominates(other, values) for other in trials.values()), k
    for k, values in trials.items():  # and every trial left out is beaten by (or ties) a point of the set
        if k not in front:
            assert any(_dominates(v, values) or v == values for v in front.values()), k


def test_objectives_are_the_named_metrics_in_order_and_refuse_a_failed_run():
    record = {"status": "ok", "metrics": {"score": 0.5, "cache_ratio": 0.25, "compressed": True, "x": "a"}}
    assert objectives(record, ["score", "cache_ratio"]) == [0.5, 0.25]
    assert objectives(record, ["cache_ratio", "score"]) == [0.25, 0.5]
    assert objectives(record, None) is None
    with pytest.raises(
        ValueError, match=r"no number for \['perplexity'\]; it has \['cache_ratio', 'score'\]"
    ):
        objectives(record, ["perplexity"])
    with pytest.raises(ValueError, match="no number for"):
        objectives(record, ["compressed"])  # a bool is not an objective
    with pytest.raises(RuntimeError, match="did not finish ok"):
        objectives({"status": "failed", "error": "ValueError: x"}, ["score"])
