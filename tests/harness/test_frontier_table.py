"""A frontier search's trials as leaderboard rows: named by their drawn overrides, paired with the
leaderboard's `full` in the same question mode, the 5% rule (inside the noise and no more than 5% of full's
score lost) and the Pareto set over score and bytes; the generated block that renders them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompress.harness import frontier
from kvcompress.harness import leaderboard as lb
from kvcompress.harness.docgen.leaderboard import frontier_block
from kvcompress.harness.report import load_records
from kvcompress.resources.files import write_json_atomic

TASKS = ("kvc_ruler_a", "kvc_ruler_b")
SEARCH = "experiments/frontier/runs/test"


def _record(folder: Path, scores: dict, ratio: float, prompt: bool = False, compressed: bool = True) -> None:
    cases = [{"task": t, "index": i, "doc": f"d{t}{i}", "score": s} for (t, i), s in scores.items()]
    metrics = {"cache_ratio": ratio, "cases": cases, "compressed": compressed}
    record = {"status": "ok", "config": {"task": {"question_in_prompt": prompt}}, "policy_name": "duo",
              "storage": "quant", "metrics": metrics}  # fmt: skip
    write_json_atomic(folder / "results.json", record)


def _scores(n_lost: int) -> dict:
    """20 samples per task, every one right but the first ``n_lost`` of task a."""
    return {(t, i): float(not (t == TASKS[0] and i < n_lost)) for t in TASKS for i in range(20)}


def _trial(root: Path, ratio: float, bits: int, n_lost: int, cache: float) -> None:
    name = f"policy.retrieval_ratio={ratio},storage.bits={bits}"
    _record(root / SEARCH / name, _scores(n_lost), cache)


def test_trials_pair_with_full_apply_the_five_percent_rule_and_mark_the_pareto_set(tmp_path):
    _record(tmp_path / lb.RUNS / "point=full,task.question_in_prompt=False", _scores(0), 1.0)
    _record(tmp_path / lb.RUNS / "point=full,task.question_in_prompt=True", _scores(20), 1.0, prompt=True)
    _trial(tmp_path, 0.44208472637456364, 4, 1, 0.11)  # -1/40 = -2.5% of full: within, inside the noise
    _trial(tmp_path, 0.3, 4, 3, 0.09)  # -3/40 = -7.5%: beyond 5%
    _trial(tmp_path, 0.5, 8, 1, 0.20)  # the same score as the first at more bytes: beaten
    _trial(tmp_path, 0.25, 4, 20, 0.08)  # loses task a: worse, outside the noise
    rows = {r["point"]: r for r in frontier.rows(frontier.trials(load_records(tmp_path, f"{SEARCH}/*")),
                                                 lb.load(tmp_path))}  # fmt: skip
    assert sorted(rows) == ["retrieval_ratio=0.25, bits=4", "retrieval_ratio=0.3, bits=4",
                            "retrieval_ratio=0.442, bits=4", "retrieval_ratio=0.5, bits=8"]  # fmt: skip
    best = rows["retrieval_ratio=0.442, bits=4"]
    assert best["diff"] == pytest.approx(-1 / 40) and best["noise"] and best["within"] and best["pareto"]
    far = rows["retrieval_ratio=0.3, bits=4"]
    assert far["diff"] == pytest.approx(-3 / 40) and not far["within"] and far["pareto"]  # fewer bytes
    assert not rows["retrieval_ratio=0.5, bits=8"]["pareto"] and rows["retrieval_ratio=0.5, bits=8"]["within"]
    lost = rows["retrieval_ratio=0.25, bits=4"]
    assert not lost["noise"] and not lost["within"] and lost["pareto"]  # the fewest bytes of all
    assert all(r["method"] == "duo / quant" and r["mode"] == lb.MODES[False] for r in rows.values())
    text = frontier_block([f"{SEARCH}/*"], {}, tmp_path, tmp_path / "docs" / "x.md")
    assert "| question after | duo / quant: retrieval_ratio=0.442, bits=4 | 40 | 0.110 |" in text
    lines = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| question")}
    assert lines["duo / quant: retrieval_ratio=0.442, bits=4"].endswith("| yes | yes |")
    assert lines["duo / quant: retrieval_ratio=0.5, bits=8"].endswith("| yes |  |")
    assert lines["duo / quant: retrieval_ratio=0.3, bits=4"].endswith("| no | yes |")
    assert frontier_block(["experiments/frontier/runs/none/*"], {}, tmp_path, tmp_path / "x.md") is None
    pending = frontier_block(["experiments/frontier/runs/none/*", "pending"], {}, tmp_path, tmp_path / "x.md")
    assert pending.startswith("_No finished trials yet")


def test_a_trial_with_no_full_in_its_mode_is_never_within(tmp_path):
    _trial(tmp_path, 0.5, 4, 0, 0.2)
    (row,) = frontier.rows(frontier.trials(load_records(tmp_path, f"{SEARCH}/*")), lb.load(tmp_path))
    assert "diff" not in row and row["within"] is False and row["pareto"]


def test_a_trial_whose_policy_never_acted_is_flagged_and_never_within(tmp_path):
    _record(tmp_path / lb.RUNS / "point=full,task.question_in_prompt=False", _scores(0), 1.0)
    _record(
        tmp_path / SEARCH / "policy.retrieval_ratio=1.0,storage.bits=8", _scores(0), 0.3, compressed=False
    )
    records = load_records(tmp_path, f"{SEARCH}/*")
    (row,) = frontier.rows(frontier.trials(records), lb.load(tmp_path))
    assert row["noise"] and row["diff"] == 0 and row["within"] is False  # full's score, but it never acted
    assert "| **did not compress** |" in frontier.markdown([row])
