"""The collector turns a sweep's results.json files into one table (Markdown, CSV) and PNG plots."""

from __future__ import annotations

import csv
import runpy
from pathlib import Path

import pytest

from kvcompress.harness.plots import pareto_front
from kvcompress.resources.files import write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
WINDOW = "kvcompress.selectors.SlidingWindowPolicy"


def _record(policy: dict, metrics: dict, task=None, status="ok") -> dict:
    config = {"policy": policy, "task": task or {"max_tokens": 512}}
    name = "full" if policy["_target_"].endswith("FullPolicy") else "sliding_window"
    return {"status": status, "policy_name": name, "config": config, "metrics": metrics}


def _speed(ppl, cache_bytes, tok_s, prompt):
    return {"perplexity": ppl, "cache_bytes": cache_bytes, "decode_tok_s": tok_s, "prompt_tokens": prompt}


def _niah_cases(kept_depths):
    return [
        {"task": "kvc_niah", "depth": d, "length": n, "exact_match": float(d in kept_depths)}
        for d in (0.0, 0.5, 1.0)
        for n in (256, 512)
    ]


@pytest.fixture
def sweep(tmp_path):
    """A fixture sweep: full and two windows at two context lengths, one NIAH run, one failed run."""
    root = tmp_path / "multirun" / "fixture"
    full = {"_target_": "kvcompress.selectors.FullPolicy"}
    runs = {
        "full-512": _record(full, _speed(20.0, 4000, 30.0, 512)),
        "full-1024": _record(full, _speed(18.0, 8000, 25.0, 1024)),
        "w64": _record({"_target_": WINDOW, "sink_tokens": 4, "window": 64}, _speed(30.0, 1000, 33.0, 512)),
        "w128": _record(
            {"_target_": WINDOW, "sink_tokens": 4, "window": 128}, _speed(35.0, 2000, 32.0, 1024)
        ),
        "niah": _record(
            {"_target_": WINDOW, "sink_tokens": 4, "window": 128},
            {"kvc_niah/exact_match": 0.33, "cases": _niah_cases({1.0})},
        ),
        "broken": _record({"_target_": WINDOW, "window": 0}, {}, status="failed"),
    }
    for name, record in runs.items():
        write_json_atomic(root / name / "results.json", record)
    return root


def test_collect_script_writes_table_csv_and_plots(sweep, tmp_path, capsys):
    out = tmp_path / "report"
    main = runpy.run_path(str(ROOT / "scripts" / "collect.py"))["main"]
    assert main([str(sweep), "--out", str(out), "--csv", str(tmp_path / "copy.csv")]) == 0
    printed = capsys.readouterr().out
    lines = (out / "summary.md").read_text().strip().splitlines()
    assert len(lines) == 2 + 6 and lines[0].startswith("| policy | params | status | perplexity")
    assert "kvc_niah/exact_match" in lines[0] and "| failed |" in (out / "summary.md").read_text()
    rows = {r["run"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert set(rows) == {"full-512", "full-1024", "w64", "w128", "niah", "broken"}
    assert float(rows["w64"]["perplexity"]) == 30.0 and rows["w64"]["params"] == "sink_tokens=4 window=64"
    assert rows["broken"]["status"] == "failed"
    for name in ("pareto.png", "niah_heatmap.png", "decode_speed.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    assert printed.strip() == (out / "summary.md").read_text().strip()  # the table is printed too
    assert (tmp_path / "copy.csv").read_text() == (out / "summary.csv").read_text()


def test_collect_reports_an_empty_folder(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "scripts" / "collect.py"))["main"]
    assert main([str(tmp_path)]) == 1
    assert f"no results.json under {tmp_path}" in capsys.readouterr().err


def test_pareto_front_keeps_only_undominated_points():
    points = [(1000, 30.0), (2000, 35.0), (4000, 20.0), (8000, 18.0), (3000, 25.0)]
    assert pareto_front(points) == [(1000, 30.0), (3000, 25.0), (4000, 20.0), (8000, 18.0)]


def test_niah_grid_averages_cases_per_depth_and_length(sweep):
    from kvcompress.harness.plots import _niah_grids
    from kvcompress.harness.report import collect

    grids = _niah_grids(collect(sweep))
    assert list(grids) == ["sliding_window sink_tokens=4 window=128 [kvc_niah]"]
    cells = next(iter(grids.values()))
    assert cells[(1.0, 256.0)] == [1.0] and cells[(0.0, 512.0)] == [0.0] and len(cells) == 6


def test_plot_labels_keep_only_the_swept_fields():
    from kvcompress.harness.plots import varying_params

    rows = [
        {"params": "bits=2 group_size=32 recent=128"},
        {"params": "bits=8 group_size=32 recent=128"},
    ]
    assert varying_params(rows) == ["bits=2", "bits=8"]
    assert varying_params(rows[:1]) == ["bits=2 group_size=32 recent=128"]


def _niah_record(folder, correct: list[bool], depths=None) -> dict:
    import json

    folder.mkdir(parents=True)
    depths = depths or list(range(len(correct)))
    rows = [{"length": 1024, "depth": d, "needle": 0, "question_in_prompt": True, "correct": c}
            for d, c in zip(depths, correct, strict=True)]  # fmt: skip
    (folder / "niah_cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    n = len(correct)
    acc = sum(correct) / n
    return {"run_dir": str(folder), "metrics": {"accuracy": acc, "accuracy_ci_low": max(0.0, acc - 0.3),
                                                "accuracy_ci_high": min(1.0, acc + 0.3)}}  # fmt: skip


def test_accuracies_of_the_same_cases_are_compared_paired(tmp_path):
    from kvcompress.harness.report import compare_records

    worse = _niah_record(tmp_path / "a", [True] * 10 + [False] * 10)
    better = _niah_record(tmp_path / "b", [True] * 20)
    text = compare_records("b", better, "a", worse, "accuracy")
    assert text.startswith("b is better than a on accuracy: paired over 20 cases, b - a = 0.5")
    same = compare_records("b", better, "c", _niah_record(tmp_path / "c", [True] * 19 + [False]), "accuracy")
    assert "not distinguishable" in same and "paired over 20 cases" in same
    other = _niah_record(tmp_path / "d", [True] * 20, depths=list(range(100, 120)))  # different cases
    assert "paired" not in compare_records("b", better, "d", other, "accuracy")
