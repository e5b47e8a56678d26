"""Intervals of positive quantities never cross zero: perplexity's interval is computed on log perplexity
(the mean NLL) and mapped back, for new records and for committed ones read back."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from kvcompress.harness.results import load_record
from kvcompress.harness.tasks.slices import combine_slices
from kvcompress.metrics.perplexity_interval import current_perplexity
from kvcompress.metrics.stats import log_interval, t_interval

SPREAD = [2.0, 3.0, 60.0]  # one slice far harder than the others: the old formula went below zero


def _slices(ppls):
    return [{"offset_tokens": 100 * i, "perplexity": p, "nll": math.log(p), "tokens_scored": 9}
            for i, p in enumerate(ppls)]  # fmt: skip


def test_the_old_formula_crossed_zero_and_the_log_interval_does_not():
    old = t_interval(SPREAD)
    assert old["low"] == pytest.approx(-60.817, abs=1e-3)  # what records used to say: below zero
    new = log_interval(SPREAD)
    logs = [math.log(p) for p in SPREAD]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    assert new["mean"] == pytest.approx(math.exp(statistics.mean(logs)))  # geometric mean, 7.11
    assert new["low"] == pytest.approx(math.exp(statistics.mean(logs) - half))
    assert new["high"] == pytest.approx(math.exp(statistics.mean(logs) + half))
    assert (
        0 < new["low"] < min(SPREAD) and new["high"] > max(SPREAD) and new["low"] < new["mean"] < new["high"]
    )


@pytest.mark.parametrize("ppls", [SPREAD, [1.01, 1.02, 900.0], [25.0, 26.0], [1.5, 1.5, 1.5, 40.0]])
def test_combined_perplexity_interval_stays_above_zero_and_holds_its_mean(ppls):
    got = combine_slices(_slices(ppls))
    assert 0 < got["perplexity_ci_low"] <= got["perplexity"] <= got["perplexity_ci_high"]
    assert got["perplexity"] == pytest.approx(math.exp(got["nll"]))  # exp of the mean NLL: the pooled value
    assert got["perplexity_ci_low"] == pytest.approx(math.exp(got["nll_ci_low"]))
    assert got["perplexity_ci_high"] == pytest.approx(math.exp(got["nll_ci_high"]))


def test_one_value_has_no_interval_and_non_positive_values_are_refused():
    assert log_interval([4.0]) == {"mean": pytest.approx(4.0), "low": None, "high": None, "n": 1}
    for bad in ([1.0, 0.0], [2.0, -1.0], [2.0, math.inf]):
        with pytest.raises(ValueError, match="finite and > 0"):
            log_interval(bad)


def test_a_committed_record_reads_back_with_todays_interval(tmp_path):
    slices = _slices(SPREAD)
    old = t_interval(SPREAD)  # how such a record was written
    metrics = {"perplexity": old["mean"], "perplexity_ci_low": old["low"], "perplexity_ci_high": old["high"],
               "slices": slices, "cache_bytes": 10}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps({"status": "ok", "config": {}, "metrics": metrics}))
    read = load_record(tmp_path)["metrics"]
    assert read["perplexity_ci_low"] > 0 and read["perplexity"] == pytest.approx(log_interval(SPREAD)["mean"])
    assert read["cache_bytes"] == 10 and read["slices"] == slices
    assert json.loads((tmp_path / "results.json").read_text())["metrics"] == metrics  # never rewritten


def test_metrics_without_per_slice_numbers_are_left_as_they_are():
    plain = {"perplexity": 20.0, "perplexity_ci_low": 19.0, "perplexity_ci_high": 21.0}
    assert current_perplexity(plain) == plain
    no_nll = {**plain, "slices": [{"offset_tokens": 0, "perplexity": 20.0}]}  # older than per-slice nll
    assert current_perplexity(no_nll) == no_nll
    accuracy = {"accuracy": 0.5, "slices": [{"nll": 1.0, "perplexity": 2.7}]}  # no perplexity metric
    assert current_perplexity(accuracy) == accuracy
