"""Results are data: every generated table in the README, docs/ and experiment READMEs equals what its
records (or the code) generate now; a table whose records are gone is dropped; cells carry intervals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcompress.harness.docgen import regenerate
from kvcompress.harness.docgen.blocks import DocsReport, regenerate_text
from kvcompress.harness.report import cell, compare_rows, markdown_table
from kvcompress.resources.files import write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
WINDOW = "kvcompress.selectors.SlidingWindowPolicy"


def test_every_generated_table_in_the_docs_matches_its_records():
    report = regenerate(ROOT, check=True)
    assert report.blocks > 0
    assert report.changed == [], (
        f"generated tables differ from their records in {report.changed}: run `make results` "
        "(or `python scripts/collect.py --docs`) and commit, or rerun the experiment"
    )
    assert report.dropped == [], f"blocks whose records are gone: {report.dropped}; run `make results`"


def test_no_internal_issue_numbers_in_the_tree():
    dirs = ["kvcompress", "docs", "experiments", "scripts", "tests", "benchmarks"]
    files = [ROOT / "README.md", ROOT / "Makefile", *(p for d in dirs for p in (ROOT / d).rglob("*"))]
    for path in files:
        if (
            path.suffix not in (".py", ".md", ".sh", ".yaml", ".txt", "")
            or not path.is_file()
            or path == THIS
        ):
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        found = re.search(r"\bissue \d+|\(issue\b|(?<![\w&])#\d+\b", text, re.I)
        assert found is None, f"{path}: {found and found.group(0)}"


def _record(root: Path, name: str, ppl: float, low: float, high: float, status: str = "ok") -> None:
    record = {
        "status": status,
        "policy_name": "sliding_window",
        "config": {
            "policy": {"_target_": WINDOW, "sink_tokens": 4, "window": 60},
            "task": {"max_tokens": 64},
        },
        "environment": {"git_commit": "abcdef0123", "threads": 1, "machine": {"cpu": "Test CPU"}},
        "metrics": {
            "perplexity": ppl,
            "perplexity_ci_low": low,
            "perplexity_ci_high": high,
            "cache_bytes": 10,
        },
    }
    write_json_atomic(root / "experiments" / "demo" / "runs" / name / "results.json", record)


DOC = (
    "# Demo\n\n<!-- generated: records experiments/demo/runs/* columns=policy,settings,perplexity -->\n"
    "<!-- /generated -->\n\nafter\n"
)


def test_a_records_block_renders_intervals_provenance_and_changed_settings(tmp_path):
    _record(tmp_path, "a", 25.0, 24.0, 26.0)
    _record(tmp_path, "b", 30.0, 29.0, 31.0, status="failed")  # never in a table
    out = regenerate_text(DOC, tmp_path, tmp_path / "docs" / "x.md", DocsReport())
    assert "| sliding_window | window=60 | 25 ± 1 |" in out
    assert "1 records in `experiments/demo/runs/*`" in out and "abcdef0" in out and "Test CPU" in out
    assert out.endswith("<!-- /generated -->\n\nafter\n")


def test_check_reports_a_stale_number_and_regeneration_fixes_it(tmp_path):
    _record(tmp_path, "a", 25.0, 24.0, 26.0)
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir(parents=True)
    doc.write_text(regenerate_text(DOC, tmp_path, doc, DocsReport()).replace("25 ± 1", "24.5 ± 1"))
    report = regenerate(tmp_path, check=True)
    assert report.changed == ["docs/results.md"] and "24.5 ± 1" in doc.read_text()  # check writes nothing
    assert regenerate(tmp_path).changed == ["docs/results.md"] and "25 ± 1" in doc.read_text()
    assert regenerate(tmp_path, check=True).changed == []


def test_a_table_whose_records_are_gone_is_dropped_unless_pending(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text(
        DOC + "<!-- generated: records experiments/later/runs/* pending -->\n<!-- /generated -->\n"
    )
    report = regenerate(tmp_path)
    text = doc.read_text()
    assert "experiments/demo" not in text and report.dropped[0].startswith(
        "README.md: records experiments/demo"
    )
    assert "No records yet in `experiments/later/runs/*`" in text  # a place kept for an experiment to come


def test_an_unknown_block_kind_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown kind 'tabel'"):
        regenerate_text(
            "<!-- generated: tabel x -->\n<!-- /generated -->\n", tmp_path, tmp_path / "a.md", DocsReport()
        )


def test_catalog_blocks_come_from_the_code(tmp_path):
    doc = (
        "<!-- generated: fields storage quant -->\n<!-- /generated -->\n<!-- generated: memory 2048 64 -->\n"
    )
    out = regenerate_text(doc + "<!-- /generated -->\n", ROOT, ROOT / "docs" / "x.md", DocsReport())
    assert "| `bits` | `4` | `2` \\| `4` \\| `8` |" in out  # the declared Choice, not a typed list
    assert "| `h2o` | 49420800 |" in out  # int32 positions counted (the formula, not an old printout)
    assert "| `block_evict` |" in out


def test_cells_show_intervals_and_speed_ranges():
    row = {"perplexity": 25.0, "perplexity_ci_low": 24.5, "perplexity_ci_high": 25.5, "accuracy": 0.8,
           "accuracy_ci_low": 0.49, "accuracy_ci_high": 0.94, "decode_tok_s": 10.0, "decode_tok_s_q1": 9.0,
           "decode_tok_s_q3": 11.0}  # fmt: skip
    assert cell(row, "perplexity") == "25 ± 0.5" and cell(row, "accuracy") == "0.8 [0.49, 0.94]"
    assert cell(row, "decode_tok_s") == "10 (IQR 9-11)" and cell({"x": 3}, "x") == "3"
    assert "25 ± 0.5" in markdown_table([row], ["perplexity"])


def test_comparing_two_rows_says_not_distinguishable_when_intervals_overlap():
    a = {"perplexity": 25.9, "perplexity_ci_low": 25.5, "perplexity_ci_high": 26.3}
    b = {"perplexity": 26.1, "perplexity_ci_low": 25.8, "perplexity_ci_high": 26.4}
    assert "not distinguishable" in compare_rows("h2o", a, "window", b)
    c = {"perplexity": 28.0, "perplexity_ci_low": 27.5, "perplexity_ci_high": 28.5}
    assert compare_rows("h2o", a, "tova", c).startswith("h2o is better than tova")
    fast = {"decode_tok_s": 12.0, "decode_tok_s_q1": 11.5, "decode_tok_s_q3": 12.5}
    slow = {"decode_tok_s": 9.0, "decode_tok_s_q1": 8.5, "decode_tok_s_q3": 9.5}
    assert compare_rows("slow", slow, "fast", fast, "decode_tok_s").startswith("fast is better")
    with pytest.raises(ValueError, match="'accuracy'"):
        compare_rows("a", a, "b", b, "accuracy")


def test_a_marker_inside_a_code_fence_is_an_example_not_a_block(tmp_path):
    doc = "```markdown\n<!-- generated: records experiments/none/* -->\n<!-- /generated -->\n```\n"
    report = DocsReport()
    assert regenerate_text(doc, tmp_path, tmp_path / "a.md", report) == doc and report.blocks == 0


def test_niah_heatmap_titles_carry_a_wilson_interval():
    from kvcompress.harness.plots import _wilson_note

    cells = {(0.0, 256.0): [1.0, 1.0, 1.0, 1.0], (50.0, 256.0): [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]}
    assert _wilson_note(cells) == "\n8/10 correct, 95% [0.49, 0.94]"
    assert _wilson_note({(0.0, 1.0): [0.5]}) == ""  # not a 0/1 score: no interval claimed


def test_niah_heatmap_with_a_missing_cell_is_drawn(tmp_path):
    """Runs at different lengths under one label leave empty (depth, length) cells: drawn blank, no crash."""
    from kvcompress.harness.plots import plot_niah

    def record(length):
        cases = [{"depth": d, "length": length, "correct": 1.0} for d in ([0, 50] if length == 2048 else [0])]
        policy = {"_target_": "kvcompress.selectors.FullPolicy"}
        return {"config": {"policy": policy}, "metrics": {"cases": cases}}

    path = plot_niah([record(2048), record(4096)], tmp_path / "niah.png")
    assert path is not None and path.stat().st_size > 0


def _slice_record(folder: Path, perplexities: list[float]) -> None:
    slices = [
        {"offset_tokens": 1000 * i, "tokens_scored": 100, "perplexity": p} for i, p in enumerate(perplexities)
    ]
    record = {
        "status": "ok",
        "config": {},
        "metrics": {"perplexity": sum(perplexities) / 3, "slices": slices},
    }
    write_json_atomic(folder / "results.json", record)


def test_compare_block_pairs_runs_over_their_slices_and_is_dropped_without_records(tmp_path):
    """Essays differ a lot (unpaired intervals overlap), but a run worse by 1.0 on every slice is worse."""
    _slice_record(tmp_path / "runs/base", [20.0, 30.0, 40.0])
    _slice_record(tmp_path / "runs/worse", [21.0, 31.1, 40.9])
    _slice_record(tmp_path / "runs/same", [20.1, 29.9, 40.0])
    doc = "<!-- generated: compare runs/base runs/worse runs/same -->\n<!-- /generated -->\n"
    text = regenerate_text(doc, tmp_path, tmp_path / "a.md", DocsReport())
    worse, same = [line for line in text.splitlines() if line.startswith("- ")]
    assert worse.startswith("- base is better than worse") and "paired over 3 slices" in worse
    assert "not distinguishable" in same
    gone = "<!-- generated: compare runs/base runs/missing -->\n<!-- /generated -->\n"
    report = DocsReport()
    assert "generated: compare" not in regenerate_text(gone, tmp_path, tmp_path / "a.md", report)


def test_compare_block_reads_rows_of_a_multi_row_record(tmp_path):
    """``PATH::ROW`` picks one row of a record with ``rows`` (bench_quant's); a missing row drops it."""

    def row(name, perplexities):
        slices = [{"offset_tokens": None, "tokens_scored": 100, "perplexity": p} for p in perplexities]
        return {"row": name, "status": "ok", "perplexity": sum(perplexities) / 3, "slices": slices}

    rows = [row("hf int4", [20.0, 30.0, 40.0]), row("ours int4", [21.0, 31.1, 40.9])]
    write_json_atomic(tmp_path / "runs/main/results.json", {"meta": {}, "rows": rows})
    doc = '<!-- generated: compare "runs/main::hf int4" "runs/main::ours int4" -->\n<!-- /generated -->\n'
    text = regenerate_text(doc, tmp_path, tmp_path / "a.md", DocsReport())
    (line,) = [line for line in text.splitlines() if line.startswith("- ")]
    assert line.startswith("- hf int4 is better than ours int4") and "paired over 3 slices" in line
    gone = '<!-- generated: compare "runs/main::hf int4" "runs/main::nope" -->\n<!-- /generated -->\n'
    assert "generated: compare" not in regenerate_text(gone, tmp_path, tmp_path / "a.md", DocsReport())


def test_a_rows_block_reads_another_list_of_a_bench_record(tmp_path):
    metrics = {"rows": [{"cache": "full", "context": 1024, "decode_tok_s": 20.0}],
               "scaling": [{"cache": "full", "decode_ms_per_1k_context": 3.25, "fit_points": 4}]}  # fmt: skip
    write_json_atomic(tmp_path / "runs/bench/results.json", {"status": "ok", "metrics": metrics})
    spec = "rows runs/* key=scaling columns=cache,decode_ms_per_1k_context"
    scaling = f"<!-- generated: {spec} -->\n<!-- /generated -->\n"
    out = regenerate_text(scaling, tmp_path, tmp_path / "x.md", DocsReport())
    assert "| full | 3.25 |" in out and "decode_tok_s" not in out
    out = regenerate_text(scaling.replace(" key=scaling", ""), tmp_path, tmp_path / "x.md", DocsReport())
    assert "| cache |\n|---|\n| full |" in out  # rows by default: they have no such column


def _decode_result(ratio: float, low: float, high: float) -> dict:
    speed = {"decode_tok_s_median": 10 * ratio, "decode_tok_s_min": 10 * low, "decode_tok_s_max": 10 * high}
    return {"vs_full_median": ratio, "vs_full_min": low, "vs_full_max": high, "policy_overhead_median": 0.05,
            "cache_bytes": 2**21, **speed}  # fmt: skip


def test_a_decode_block_renders_a_decode_speed_record_with_its_ranges(tmp_path):
    results = {"full": _decode_result(1.0, 1.0, 1.0), "int4": _decode_result(1.2, 1.1, 1.3)}
    env = {"OMP_NUM_THREADS": "1", "loadavg_before": [2.0], "loadavg_after": [3.0]}
    record = {"context": 4096, "rounds": 4, "steps_per_round": 4, "dtype": "torch.float32", "env": env,
              "results": results}  # fmt: skip
    write_json_atomic(tmp_path / "exp/decode.json", record)
    doc = "<!-- generated: decode exp/decode.json names=int4 -->\n<!-- /generated -->\n"
    out = regenerate_text(doc, tmp_path, tmp_path / "x.md", DocsReport())
    assert "| int4 | 1.2 (range 1.1-1.3) | 0.05 | 2 |" in out and "| full |" not in out  # vs_full_cpu absent
    assert "context 4096, 4 rounds of 4 steps" in out and "load average 2.0 before and 3.0 after" in out
    with pytest.raises(ValueError, match=r"\['int8'\] not in exp/decode.json"):
        regenerate_text(doc.replace("names=int4", "names=int8"), tmp_path, tmp_path / "x.md", DocsReport())
    (tmp_path / "exp/decode.json").unlink()
    assert regenerate_text(doc, tmp_path, tmp_path / "x.md", DocsReport()) == ""  # dropped with its record
