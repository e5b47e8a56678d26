"""`task=lm_eval` through the Hydra task function, and `kvcompress-lm-eval` running kvc_niah offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvcompress.core.cache import make_policy
from kvcompress.eval.hydra_task import cases, flatten_results, mean_score

ROOT = Path(__file__).resolve().parents[2]


def test_flatten_results_names_filters_only_when_a_metric_has_several():
    results = {"results": {"a": {"alias": "a", "acc,none": 0.5, "acc_stderr,none": 0.1},
                           "b": {"em,strict": 1.0, "em,flex": 0.0, "ppl,none": 3.0}}}  # fmt: skip
    assert flatten_results(results) == {"a/acc": 0.5, "b/em_strict": 1.0, "b/em_flex": 0.0, "b/ppl": 3.0}
    samples = {
        "b": [{"doc": {"depth": 0.5, "length": 64, "id": "x", "context": "long"}, "em": 1.0, "ppl": 2}]
    }
    rows = cases({"results": results["results"], "samples": samples})
    assert rows == [
        {"task": "b", "depth": 0.5, "length": 64, "id": "x", "doc": rows[0]["doc"], "em": 1.0, "ppl": 2.0}
    ]
    other = {"b": [{**samples["b"][0], "doc": {**samples["b"][0]["doc"], "context": "other"}}]}
    assert (
        cases({"results": results["results"], "samples": other})[0]["doc"] != rows[0]["doc"]
    )  # a hash of it
    assert mean_score(results) is None  # a task without a score: no mean of some of them
    scored = {"results": {"x": {"score,none": 0.5}, "y": {"score,none": 1.0, "alias": "y"}}}
    assert mean_score(scored) == 0.75 and mean_score({"results": {}}) is None
    grouped = {"results": {"g": {"score,none": 0.9}, **scored["results"], "z": {"score,none": 0.0}},
               "group_subtasks": {"g": ["x", "y"], "x": [], "y": [], "z": []}}  # fmt: skip
    assert mean_score(grouped) == 0.5  # the group's aggregate row is not a fourth task
    ruler = {
        "b": [{"doc": {"index": 7, "input": "x"}, "em": 0.5}]
    }  # RULER documents carry an index, no depth
    assert cases({"results": results["results"], "samples": ruler})[0]["index"] == 7


def test_hydra_task_scores_niah_and_records_cache_bytes(fake_cache, tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompress.eval.hydra_task import run

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    cfg = OmegaConf.load(ROOT / "kvcompress" / "conf" / "task" / "lm_eval.yaml")
    cfg.tasks, cfg.limit = ["kvc_niah"], 3
    policy = make_policy("sliding_window", sink_tokens=2, window=30)
    metrics = run(model, tok, policy, cfg)
    assert 0.0 <= metrics["kvc_niah/exact_match"] <= 1.0 and metrics["requests"] == 3
    assert [c["depth"] for c in metrics["cases"]] == [0.0, 0.0, 0.25] and metrics["cases"][0]["length"] == 256
    assert set(metrics["cases"][0]) == {"task", "depth", "length", "id", "doc", "exact_match"}
    cfg_ = model.config
    kept_bytes = 2 * cfg_.num_hidden_layers * cfg_.num_key_value_heads * 32 * (cfg_.hidden_size // 4) * 4
    assert metrics["cache_bytes"] == kept_bytes and metrics["full_cache_bytes"] > 4 * kept_bytes
    assert metrics["cache_ratio"] == pytest.approx(kept_bytes / metrics["full_cache_bytes"])


@pytest.mark.slow
def test_cli_runs_kvc_niah_offline(fake_cache, tiny_checkpoint, tmp_path):
    args = f"pretrained={tiny_checkpoint},policy=sliding_window,window=16,max_length=600"
    cmd = [sys.executable, "-m", "kvcompress.eval.cli", "run", "--model", "kvcompress", "--model_args", args,
           "--device", "cpu", "--tasks", "kvc_niah", "--limit", "2",
           "--output_path", str(tmp_path / "out")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvc_niah" in proc.stdout and "exact_match" in proc.stdout
    (result_file,) = (tmp_path / "out").rglob("results_*.json")
    result = json.loads(result_file.read_text())
    assert result["results"]["kvc_niah"]["exact_match,number"] in (0.0, 0.5, 1.0)
    info = result["config"]["kvcompress"]
    assert (
        info["policy"]
        == {"name": "sliding_window", "sink_tokens": 4, "window": 16, "storage": {"name": "dense"}}
        and info["requests"] == 2
    )
