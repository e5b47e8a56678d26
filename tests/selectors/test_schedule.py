"""Per-layer schedules: the right policy on the right layer, clear errors for bad layer names."""

from __future__ import annotations

import pytest
from helpers import stream_logits

from kvcompress import build_cache
from kvcompress.selectors import FullPolicy, SchedulePolicy, SlidingWindowPolicy
from kvcompress.selectors.schedule import parse_layers


@pytest.mark.parametrize(
    "spec,expected",
    [(0, [0]), (-1, [29]), ("0-1", [0, 1]), ("-2:", [28, 29]), ("1:3", [1, 2]), (["0", "5-6"], [0, 5, 6])],
)
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 30) == expected


@pytest.mark.parametrize("spec", [30, "28-31", "x"])
def test_parse_layers_rejects_layers_the_model_lacks(spec):
    with pytest.raises(ValueError, match="schedule layers"):
        parse_layers(spec, 30)


def test_schedule_gives_each_layer_its_policy(llama, tokens):
    window = SlidingWindowPolicy(sink_tokens=1, window=7)
    sched = SchedulePolicy(default=window, rules=[{"layers": "0", "policy": FullPolicy()}])
    cache = build_cache(sched, llama)
    stream_logits(llama, tokens, cache, chunk=6)
    stored = [s["tokens_stored"] for s in cache.stats()]
    assert stored == [48, 8, 8]
    assert [s["policy"] for s in cache.stats()] == ["full", "sliding_window", "sliding_window"]


def test_schedule_without_default_must_cover_every_layer(llama):
    with pytest.raises(ValueError, match="no default"):
        build_cache(SchedulePolicy(rules=[{"layers": "0-1", "policy": FullPolicy()}]), llama)


def test_schedule_from_dict_config(llama):
    sched = SchedulePolicy(
        default={"_target_": "kvcompress.selectors.FullPolicy"},
        rules=[
            {"layers": "-1:", "policy": {"_target_": "kvcompress.selectors.SlidingWindowPolicy", "window": 3}}
        ],
    )
    assert isinstance(sched.assignment(3)[2], SlidingWindowPolicy) and sched.assignment(3)[2].window == 3
