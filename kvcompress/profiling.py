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
    """Accumulates seconds spent inside policy code while ``enabled``."""

    def __init__(self):
        self.enabled = False
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    @contextmanager
    def measure(self):
        if not self.enabled:
            yield
            return
        sync_device()
        start = time.perf_counter()
        try:
            yield
        finally:
            sync_device()
            self.seconds += time.perf_counter() - start
            self.calls += 1


def sync_device() -> None:
    """Wait for queued CUDA work, where CUDA is in use (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
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
