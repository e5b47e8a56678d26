"""The leaderboard from records: scores with bootstrap intervals, paired differences from `full` on the
samples both answered, refusal of pairs over other documents, and a figure tied to its table by a digest
(the committed one included)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcompress.harness import leaderboard as lb
from kvcompress.harness.docgen.leaderboard import block
from kvcompress.resources.files import write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("kvc_ruler_a", "kvc_ruler_b")


def _write(root: Path, point: str, scores: dict, ratio: float, prompt: bool = True, doc: str = "d",
           compressed: bool = True) -> None:  # fmt: skip
    """A leaderboard record: per-sample ``scores`` {(task, index): score}."""
    cases = [{"task": t, "index": i, "doc": f"{doc}{t}{i}", "score": s} for (t, i), s in scores.items()]
    record = {"status": "ok", "config": {"task": {"question_in_prompt": prompt}},
              "metrics": {"cache_ratio": ratio, "cases": cases, "compressed": compressed}}  # fmt: skip
    write_json_atomic(
        root / lb.RUNS / f"point={point},task.question_in_prompt={prompt}" / "results.json", record
    )


def _scores(values_a, values_b) -> dict:
    return {
        **{(TASKS[0], i): v for i, v in enumerate(values_a)},
        **{(TASKS[1], i): v for i, v in enumerate(values_b)},
    }


def test_rows_pair_each_point_with_full_on_the_shared_samples(tmp_path):
    full = _scores([1.0] * 20, [1.0] * 10 + [0.0] * 10)  # task means 1.0 and 0.5: score 0.75
    _write(tmp_path, "full", full, 1.0)
    _write(tmp_path, "snapkv_r75", _scores([0.0] * 20, [0.0] * 20), 0.25)  # loses everything
    _write(tmp_path, "h2o_r75", {**full, (TASKS[0], 3): 0.0}, 0.26)  # one sample lost: noise
    _write(tmp_path, "h2o_r50", {k: v for k, v in full.items() if k[1] < 5}, 0.5)  # 5 samples per task only
    _write(tmp_path, "tova_r50", full, 1.0, compressed=False)  # a policy that never acted
    rows = {r["point"]: r for r in lb.rows(lb.load(tmp_path))}
    assert rows["full"]["score"] == pytest.approx(0.75) and "diff" not in rows["full"]
    assert rows["full"]["score_low"] < 0.75 < rows["full"]["score_high"]  # task b's samples vary
    lost = rows["snapkv_r75"]
    assert lost["diff"] == pytest.approx(-0.75) and lost["diff_high"] < 0 and not lost["noise"]
    one = rows["h2o_r75"]
    assert one["diff"] == pytest.approx(-1 / 40) and one["diff_low"] < 0 and one["noise"]  # (-1/20) / 2 tasks
    assert one["diff_high"] == pytest.approx(0.0)
    few = rows["h2o_r50"]
    assert few["paired"] == few["samples"] == 10 and few["diff"] == pytest.approx(0.0)
    assert lost["method"] == "snapkv" and rows["h2o_r50"]["method"] == rows["h2o_r75"]["method"] == "h2o"
    assert lb.method_of("kvzip_r75_int4") == "kvzip+int4" and lb.method_of("quant_int2") == "quant"
    assert lb.method_of("tiered") == "tiered (device bytes)"
    assert lb.method_of("turboquant_int2") == "turboquant" and lb.method_of("duo_r75_int8") == "duo+int8"
    assert lb.method_of("kvzip_r75_turboquant_int4") == "kvzip+turboquant_int4"
    assert lb.method_of("expected_attention_r50_mean") == "expected_attention_mean"
    table = lb.markdown(lb.rows(lb.load(tmp_path)))
    assert "| question in prompt | snapkv | `snapkv_r75` | 40 | 0.250 | 0.000 [0.000, 0.000] |" in table
    assert "worse" in table and "inside the noise" in table and "reference" in table
    assert "| `tova_r50` | 40 | 1.000 |" in table and "**did not compress** (inside the noise) |" in table
    assert table.count("did not compress") == 1  # full never compresses, and is the reference


def test_bootstrap_interval_covers_the_mean_and_shrinks_with_samples():
    rng = np.random.default_rng(1)
    small = (rng.random(20) < 0.5).astype(float)
    large = (rng.random(400) < 0.5).astype(float)
    (m1, lo1, hi1), (m2, lo2, hi2) = (
        lb.bootstrap(v, [("t", i) for i in range(len(v))]) for v in (small, large)
    )
    assert lo1 <= m1 <= hi1 and lo2 <= m2 <= hi2 and (hi2 - lo2) < (hi1 - lo1)
    assert m1 == pytest.approx(small.mean())


def test_points_over_other_documents_are_not_paired(tmp_path):
    _write(tmp_path, "full", _scores([1.0] * 4, [1.0] * 4), 1.0)
    _write(tmp_path, "snapkv_r75", _scores([1.0] * 4, [1.0] * 4), 0.25, doc="other")
    with pytest.raises(ValueError, match="different documents under the same index"):
        lb.rows(lb.load(tmp_path))


def test_block_writes_a_figure_whose_digest_is_the_tables(tmp_path):
    _write(tmp_path, "full", _scores([1.0] * 8, [0.0] * 8), 1.0)
    _write(tmp_path, "full", _scores([1.0] * 8, [0.0] * 8), 1.0, prompt=False)
    _write(tmp_path, "snapkv_r75", _scores([1.0] * 8, [1.0] * 8), 0.25, prompt=False)
    md = tmp_path / "docs" / "results.md"
    body = block([f"{lb.RUNS}/*"], {"out": "figures/leaderboard.png"}, tmp_path, md)
    digest = lb.digest(lb.rows(lb.load(tmp_path)))
    assert f"`{digest}`" in body and lb.figure_digest(tmp_path / "docs/figures/leaderboard.png") == digest
    assert "| question after | snapkv | `snapkv_r75` | 16 | 0.250 |" in body
    _write(tmp_path, "snapkv_r75", _scores([0.0] * 8, [1.0] * 8), 0.25, prompt=False)  # the records change
    assert lb.digest(lb.rows(lb.load(tmp_path))) != digest  # so the figure on disk is stale


def test_committed_leaderboard_figure_matches_the_committed_records():
    md = ROOT / "docs" / "results.md"
    spec = next((line for line in md.read_text().splitlines() if "<!-- generated: leaderboard" in line), None)
    if spec is None:
        pytest.skip("docs/results.md has no leaderboard block")
    points = lb.load(ROOT)
    if not points:
        pytest.skip("no leaderboard records committed yet")
    out = spec.split("out=")[1].split()[0]
    assert lb.figure_digest(md.parent / out) == lb.digest(lb.rows(points)), (
        "run `make leaderboard` and commit"
    )


def test_the_table_says_what_each_point_really_removed_and_when_it_evicted(tmp_path):
    """The effective compression ratio and ``evict_at`` from the record (pyramidkv: its inner policy's); a
    record written before they existed leaves the cell blank."""
    full = _scores([1.0] * 4, [1.0] * 4)
    _write(tmp_path, "full", full, 1.0)
    for point, policy in (("snapkv_r875", {"evict_at": "prefill"}),
                          ("pyramidkv_r875", {"policy": {"evict_at": "prefill"}})):  # fmt: skip
        path = tmp_path / lb.RUNS / f"point={point},task.question_in_prompt=True" / "results.json"
        _write(tmp_path, point, full, 0.2)
        record = {"status": "ok", "config": {"task": {"question_in_prompt": True}, "policy": policy},
                  "metrics": {"cache_ratio": 0.2, "effective_compression_ratio": 0.84321,
                              "cases": [{"task": t, "index": i, "doc": f"d{t}{i}", "score": s}
                                        for (t, i), s in full.items()]}}  # fmt: skip
        write_json_atomic(path, record)
    table = lb.markdown(lb.rows(lb.load(tmp_path)))
    assert table.count("| 0.843, prefill |") == 2
    assert [line for line in table.splitlines() if "`full`" in line][0].endswith("| reference |  |")
