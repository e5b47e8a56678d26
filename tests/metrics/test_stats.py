"""Intervals on every number: values of the t, Wilson and IQR summaries, disjoint perplexity slices, the
comparison's wording, and the tasks that carry them (perplexity over slices, NIAH with two needles)."""

from __future__ import annotations

import math
import statistics

import pytest
from omegaconf import OmegaConf

from kvcompress import build_cache
from kvcompress.core.cache import make_policy
from kvcompress.harness.tasks import niah
from kvcompress.harness.tasks import perplexity as ppl_task
from kvcompress.harness.tasks.grid import accuracy_metrics
from kvcompress.harness.tasks.slices import combine_slices, slice_ids, slice_starts
from kvcompress.metrics import decode_perplexity
from kvcompress.metrics.stats import compare, median_iqr, t975, t_interval, wilson

TEXT = "The cat sat on the mat. A dog ran far away! Birds sing at dawn. Is it late? " * 12


def test_wilson_matches_a_hand_computed_case():
    # 8 of 10, z = 1.96: centre (0.8 + z^2/20) / (1 + z^2/10) = 0.71674, half-width 0.22650
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4) and high == pytest.approx(0.94332, abs=1e-4)
    assert wilson(0, 10) == (0.0, pytest.approx(0.27753, abs=1e-4))  # not empty at 0/n
    assert wilson(10, 10)[0] == pytest.approx(0.72247, abs=1e-4) and wilson(10, 10)[1] <= 1.0
    with pytest.raises(ValueError, match="successes"):
        wilson(11, 10)


def test_t_interval_matches_a_hand_computed_case():
    values = [24.0, 26.0, 25.0, 27.0]  # mean 25.5, sd 1.29099, t(3) = 3.182: half 2.05426
    ci = t_interval(values)
    assert ci["mean"] == 25.5 and ci["n"] == 4
    assert ci["low"] == pytest.approx(25.5 - 3.182 * 1.290994 / 2, abs=1e-4)
    assert ci["high"] - ci["mean"] == pytest.approx(ci["mean"] - ci["low"])
    assert t_interval([3.0]) == {"mean": 3.0, "low": None, "high": None, "n": 1}  # no spread from one
    assert t975(1) == 12.706 and t975(31) == pytest.approx(2.0395, abs=1e-3)
    assert t975(200) == pytest.approx(1.9719, abs=1e-3)


def test_median_and_interquartile_range():
    got = median_iqr([5.0, 1.0, 3.0, 2.0, 4.0])
    assert got == {"median": 3.0, "q1": 2.0, "q3": 4.0}
    assert median_iqr([7.0]) == {"median": 7.0, "q1": 7.0, "q3": 7.0}


def test_comparison_says_not_distinguishable_when_intervals_overlap():
    said = compare("h2o", (25.9, 25.2, 26.6), "sliding_window", (26.3, 25.6, 27.0), "perplexity")
    assert "not distinguishable" in said and "overlap" in said
    said = compare("h2o", (25.9, 25.7, 26.1), "tova", (28.3, 27.9, 28.7), "perplexity")
    assert said.startswith("h2o is better than tova on perplexity") and "disjoint" in said
    said = compare("a", (0.4, 0.2, 0.6), "b", (0.9, 0.7, 0.98), "accuracy", lower_is_better=False)
    assert said.startswith("b is better than a")
    assert "not distinguishable" in compare("a", (1.0, None, None), "b", (2.0, 1.9, 2.1))


def _ppl_cfg(tmp_path, **over):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    cfg = OmegaConf.load("kvcompress/conf/task/perplexity.yaml")
    cfg.update(text=str(path), max_tokens=48, slices=3, slice_stride=200, speed=False, progress=False)
    cfg.update(**over)
    return cfg


def test_slices_are_disjoint_and_refused_when_they_overlap(tmp_path, char_tokenizer):
    cfg = _ppl_cfg(tmp_path, offset_tokens=10)
    starts = slice_starts(cfg)
    assert starts == [10, 210, 410]
    spans = [set(range(s, s + cfg.max_tokens)) for s in starts]
    assert all(not (a & b) for i, a in enumerate(spans) for b in spans[i + 1 :])
    ids = slice_ids(char_tokenizer, TEXT, starts, cfg.max_tokens)
    whole = char_tokenizer(TEXT, return_tensors="pt").input_ids
    assert [p.shape[1] for p in ids] == [48, 48, 48] and (ids[2] == whole[:, 410:458]).all()
    with pytest.raises(ValueError, match="task.slice_stride=40 must be >= task.max_tokens=48"):
        slice_starts(_ppl_cfg(tmp_path, slice_stride=40))
    with pytest.raises(ValueError, match="task.slices=0"):
        slice_starts(_ppl_cfg(tmp_path, slices=0))
    with pytest.raises(ValueError, match="task.slices=9"):
        slice_ids(char_tokenizer, TEXT, slice_starts(_ppl_cfg(tmp_path, slices=9)), 48)


def test_perplexity_task_reports_the_mean_over_slices_and_keeps_each(llama, char_tokenizer, tmp_path):
    cfg = _ppl_cfg(tmp_path)
    got = ppl_task.run(llama, char_tokenizer, make_policy("full"), cfg)
    whole = char_tokenizer(TEXT, return_tensors="pt").input_ids
    own = [
        decode_perplexity(llama, whole[:, s : s + 48], build_cache("full", llama), progress=False)[
            "perplexity"
        ]
        for s in (0, 200, 400)
    ]
    assert [s["offset_tokens"] for s in got["slices"]] == [0, 200, 400]
    assert [s["perplexity"] for s in got["slices"]] == pytest.approx(own, rel=1e-5)
    logs = [math.log(p) for p in own]  # the interval is on log perplexity (mean NLL), then exponentiated
    assert got["perplexity"] == pytest.approx(math.exp(statistics.mean(logs)), rel=1e-5)
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    assert got["perplexity_ci_high"] == pytest.approx(math.exp(statistics.mean(logs) + half), rel=1e-4)
    assert got["perplexity_ci_low"] == pytest.approx(math.exp(statistics.mean(logs) - half), rel=1e-4)
    assert got["tokens_scored"] == 3 * 47 and got["slice_count"] == 3


def test_combined_slices_compress_only_when_every_slice_did():
    base = {
        "perplexity": 2.0,
        "nll": math.log(2.0),
        "tokens_scored": 9,
        "cache_bytes": 10,
        "tokens_evicted": 0,
    }
    got = combine_slices([{**base, "compressed": True}, {**base, "compressed": False, "warning": "w"}])
    assert got["compressed"] is False and got["warning"] == "w" and got["tokens_evicted"] == 0
    assert (
        got["perplexity_ci_low"] == pytest.approx(2.0) == got["perplexity_ci_high"]
    )  # no spread: zero width


def test_combined_slices_count_the_backends_of_every_slice():
    base = {"perplexity": 2.0, "nll": 0.7, "tokens_scored": 9, "cache_bytes": 10}
    ran = [{"cpu": 6, "sdpa": 2}, {"sdpa": 8}, {"torch": 1}]
    got = combine_slices([{**base, "attention_backends": r} for r in ran])
    assert got["attention_backends"] == {"cpu": 6, "sdpa": 10, "torch": 1}


def test_niah_runs_every_needle_and_accuracy_carries_a_wilson_interval(llama, char_tokenizer, tmp_path):
    path = tmp_path / "hay.txt"
    path.write_text(TEXT)
    cfg = OmegaConf.load("kvcompress/conf/task/niah.yaml")
    assert len(cfg.depths) >= 10 and len(niah.needles(cfg)) >= 2  # the defaults
    cfg.update(text=str(path), lengths=[90], depths=[0, 100], max_new_tokens=3, progress=False)
    second = niah.make_case(char_tokenizer, cfg, 90, 50.0, 1)
    assert cfg.extra_needles[0].needle in second.context and second.answer == cfg.extra_needles[0].answer
    got = niah.run(llama, char_tokenizer, make_policy("full"), cfg)
    assert got["cases_total"] == 4 and sorted(c["needle"] for c in got["cases"]) == [0, 0, 1, 1]
    low, high = wilson(got["correct"], 4)
    assert (got["accuracy_ci_low"], got["accuracy_ci_high"]) == (low, high)
    cfg.extra_needles = []  # an old single-needle config
    assert niah.needles(cfg) == [(cfg.needle, cfg.question, str(cfg.answer))]
    del cfg["extra_needles"]
    assert len(niah.needles(cfg)) == 1
    with pytest.raises(ValueError, match=r"extra_needles\[0\] lacks \['answer'\]"):
        niah.needles(OmegaConf.merge(cfg, {"extra_needles": [{"needle": "x", "question": "y"}]}))


def test_accuracy_metrics_over_cases():
    got = accuracy_metrics([{"correct": c} for c in [True] * 8 + [False] * 2])
    assert got["accuracy"] == 0.8 and got["correct"] == 8 and got["cases_total"] == 10
    assert got["accuracy_ci_low"] == pytest.approx(0.49016, abs=1e-4)


def test_paired_comparison_removes_the_spread_between_texts():
    from kvcompress.metrics.stats import compare_paired

    full, window = [34.9, 32.5, 62.5], [35.4, 33.1, 63.3]  # every slice a little worse, texts far apart
    assert "not distinguishable" in compare(
        "window", (43.9, *[43.9 - 41.0, 43.9 + 41.0]), "full", (43.3, 43.3 - 41.0, 43.3 + 41.0)
    )  # unpaired: the essays' spread hides it
    said = compare_paired("window", window, "full", full, "perplexity")
    # differences 0.5, 0.6, 0.8: mean 0.63333, sd 0.15275, t(2) = 4.303: half 0.37948, [0.25385, 1.0128]
    assert said.startswith("full is better than window on perplexity: paired over 3 slices")
    assert "window - full = 0.6333 [0.2538, 1.013]" in said
    said = compare_paired("a", [1.0, 2.0, 3.0], "b", [1.5, 1.5, 3.1], "perplexity")
    assert "not distinguishable" in said and "includes 0" in said
    with pytest.raises(ValueError, match="same number"):
        compare_paired("a", [1.0], "b", [1.0, 2.0])


def test_records_are_compared_paired_when_they_scored_the_same_slices():
    from kvcompress.harness.report import compare_records

    def record(ppls, offsets=(0, 100, 200)):
        pairs = zip(offsets, ppls, strict=True)
        slices = [{"offset_tokens": o, "tokens_scored": 9, "perplexity": p} for o, p in pairs]
        mean = sum(ppls) / len(ppls)
        metrics = {"perplexity": mean, "perplexity_ci_low": mean - 20, "perplexity_ci_high": mean + 20}
        return {"metrics": {**metrics, "slices": slices}, "config": {"policy": {}}}

    a, b = record([30.5, 40.6, 60.8]), record([30.0, 40.0, 60.0])
    assert compare_records("a", a, "b", b).startswith("b is better than a on perplexity: paired")
    other = record([30.0, 40.0, 60.0], offsets=(0, 50, 200))  # other slices: unpaired, overlapping
    assert "their 95% intervals overlap" in compare_records("a", a, "c", other)
