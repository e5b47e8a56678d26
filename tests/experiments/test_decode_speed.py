"""The decode benchmark's paired mode: each contender is divided by the ``full`` run made just before it,
and ``full`` decodes every sample from the same restored context."""

from __future__ import annotations

import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "fused" / "decode_speed.py"


class FakeCache:
    def __init__(self, log):
        self.log, self.context = log, 100

    def snapshot(self):
        return self.context

    def restore(self, snap):
        self.log.append("restore")
        self.context = snap


def test_paired_rounds_divide_each_contender_by_the_full_run_just_before_it():
    measure = runpy.run_path(str(SCRIPT))["measure_paired"]
    space, log, clock = measure.__globals__, [], [0]

    def decode(model, state, steps):  # the machine slows down by 10% per measurement
        clock[0] += 1
        state["cache"].context += steps
        log.append((state["name"], state["cache"].context))
        speed = state["speed"] / 1.1 ** clock[0]
        return speed, 0.0, speed

    def warm_up(model, state, steps=3):
        state["cache"].context += steps

    space |= {"decode": decode, "warm_up": warm_up}
    states = {n: {"name": n, "cache": FakeCache(log), "next": 0, "speed": s} for n, s in
              [("full", 10.0), ("a", 12.0), ("b", 15.0)]}  # fmt: skip
    samples, fulls = measure(None, states, ["full", "a", "b"], rounds=3, steps=4)
    assert len(samples["full"]) == 6 and len(samples["a"]) == len(samples["b"]) == 3
    ratios = space["ratios"]
    # adjacent pairs: the drift of one measurement (1.1x) is all that is left, not a round's drift
    assert all(abs(r - 1.2 / 1.1) < 1e-9 for r in ratios(samples["a"], fulls["a"], 0))
    assert all(abs(r - 1.5 / 1.1) < 1e-9 for r in ratios(samples["b"], fulls["b"], 2))
    full_contexts = [c for name, c in (e for e in log if e != "restore") if name == "full"]
    assert full_contexts == [105] * 6  # restored, one untimed step, then 4 timed steps: same context
    assert log.count("restore") == 6
