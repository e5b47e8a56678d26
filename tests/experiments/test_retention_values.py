"""experiments/leaderboard/retention_values.py: tables and paired differences from a constructed record."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "leaderboard" / "retention_values.py"
rv = runpy.run_path(str(SCRIPT))


def case(value: str, response: str, hits: list[list[int]], correct: bool) -> dict:
    n = len(value)
    return {
        "kind": "digits5", "value": value, "depth": 50.0, "answer_tokens": n, "response": response,
        "correct": correct, "answer_first": hits, "answer_all": hits, "answer_any": [[n, n]] * len(hits),
        "needle_first": [[n, n]] * len(hits), "needle_tokens": n, "cache_ratio": 0.5,
    }  # fmt: skip


def record(keep: dict, cases: list[dict]) -> dict:
    setting = {"policy": "snapkv", "ratio": 0.5, "question_in_prompt": True, "keep": keep, "samples": cases}
    return {"settings": {"snapkv|0.5|True": setting}}


def test_response_kinds():
    kind = rv["response_kind"]
    assert kind("10555", " 105. It's a number") == "stopped"
    assert kind("91469225", " 91469225292") == "ran_on"
    assert kind("01a78f77-5458-deb9", " 01a7b1c3d.") == "diverged"
    assert kind("2469414", " 1.") == "other" and kind("2469414", "") == "other"


def test_table_counts_retention_and_losses():
    before = record({}, [
        case("12345", " 123.", [[5, 2], [0, 0]], False),  # partial: one pair whole, one partial, two none
        case("67890", " 67890.", [[5, 5], [5, 5]], True),
    ])  # fmt: skip
    rows = rv["table"](before).splitlines()
    assert rows[2] == (
        "| snapkv | 0.5 | in prompt | 1/2 [0.09, 0.91] | 0.675 | 0.625 | 1/2 | 0 / 1 / 0 | 1 / 0 / 0 / 0 "
        "| 1.000 | 0.500 |"
    )
    same = before["settings"]["snapkv|0.5|True"]["samples"][1]
    after = record({"span": 8}, [case("12345", " 12345.", [[5, 5], [5, 4]], True), same])
    pairs = rv["pairs"](before, after).splitlines()
    assert pairs[2].startswith(
        "| snapkv span=8 | 0.5 | in prompt | 0.500 → 1.000 | +0.500 [-5.853, +6.853] |"
    )


def test_records_are_written_whole(tmp_path):
    path = tmp_path / "runs" / "r.json"
    rv["write"](path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_divergence_reads_the_token_where_the_copy_went_wrong():
    wrong = case("12345", " 123.", [[3, 3]], False) | {"answer_tokens_read": [1.0, 1.0, 0.5, 0.1, 0.0]}
    right = case("67890", " 67890.", [[5, 5]], True) | {"answer_tokens_read": [1.0, 0.9, 0.8, 0.7, 0.6]}
    row = rv["divergence_table"](record({}, [wrong, right])).splitlines()[2]
    assert row == "| snapkv | 0.5 | in prompt | 1 | 0.833 | 0.100 | 0.600 (1) |"
