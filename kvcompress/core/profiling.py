"""Wall-clock accounting of the time spent in policy code (cache updates, attention hooks).

Off by default (one attribute read per call); the benchmark turns it on to report per-step policy
overhead separately from the model's own compute. While on, it synchronises the device before each clock
read, so queued kernels are charged to the code that launched them (and never while it is off: the
decode path itself stays free of host syncs).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PolicyTimer:
    """Accumulates seconds spent inside policy code while ``enabled``. ``with TIMER.measure():`` times a
    block (blocks may nest: each is counted); the decode path instead calls ``start()``/``stop()`` behind an
    ``if TIMER.enabled`` check, so a step pays one attribute read while the timer is off."""

    def __init__(self):
        self.enabled = False
        self.seconds = 0.0
        self.calls = 0
        self._starts: list[float | None] = []

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._starts.clear()

    def start(self) -> None:
        """Begin a timed block (only while ``enabled``); ``stop()`` ends it."""
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)

    def measure(self) -> PolicyTimer:
        return self

    def __enter__(self) -> None:
        if not self.enabled:
            self._starts.append(None)
            return
        sync_device()
        self._starts.append(time.perf_counter())

    def __exit__(self, *exc) -> bool:
        start = self._starts.pop()
        if start is not None:
            sync_device()
            self.seconds += time.perf_counter() - start
            self.calls += 1
        return False


def sync_device() -> None:
    """Wait for queued CUDA work, where CUDA is in use (a no-op on CPU). ``is_initialized`` alone decides:
    it is False wherever CUDA is unavailable, and costs a flag read where ``is_available`` asks the driver."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


TIMER = PolicyTimer()


@contextmanager
def timing():
    """Enable the timer for a block; yields it (reset on entry)."""
    TIMER.reset()
    TIMER.enabled = True
    try:
        yield TIMER
    finally:
        TIMER.enabled = False
