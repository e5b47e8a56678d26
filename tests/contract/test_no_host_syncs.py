"""Steady-state decode never makes the host wait for the device: for every selector x storage cell, at batch
1 and in a left-padded batch of 2, a ``TorchDispatchMode`` (``kvcompress.metrics.host_syncs``) counts every
aten op that would block the host on a GPU (values read back, data-shaped results, tensors built from host
data) and ``tolist``. Zero per layer-step in every cell but ``tiered`` (at most one: the pages to fetch);
once per forward at most the padding check and the model's own mask, and none without padding.

The cells and counting are those of ``experiments/gpu/host_syncs.py`` (the record with its table)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "host_syncs.py"
LAYER_STEP_ALLOWANCE = {"tiered": 1.0}  # the indices of the pages to fetch
PER_FORWARD_PADDED = 2.0  # the forward's padding check and transformers' own mask decision


def _script():
    spec = importlib.util.spec_from_file_location("gpu_host_syncs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.WARM, module.COUNTED = 2, 3
    return module


SYNCS = _script()
MODEL = SYNCS.model_of("cpu", torch.float32, head_dim=16, layers=2)
SELECTORS = sorted({sel for sel, _, _ in SYNCS.cells()})


def test_the_ratio_path_is_counted_for_the_selectors_sized_by_a_ratio():
    assert SYNCS.budget_paths("h2o") == ["fixed", "ratio", "prefill"] and SYNCS.budget_paths("full") == [
        "fixed"
    ]
    policy = SYNCS.policy_of("tova", {"name": "dense"}, "ratio")
    assert policy.budget is None and policy.compression_ratio == 0.5


@pytest.mark.parametrize("selector", SELECTORS)
def test_steady_decode_reads_nothing_back_per_layer_step(selector):
    """Both budget paths of each selector: its test parameters (often a fixed budget) and a ratio (the
    default of most eviction selectors, which sizes each padded row from its own real tokens)."""
    ran = 0
    for sel, storage, params in SYNCS.cells([selector]):
        for path, batch in ((p, b) for p in SYNCS.budget_paths(sel) for b in (1, 2)):
            got = SYNCS.count(MODEL, sel, params, batch, path)
            if got["status"] == "refused":
                continue
            ran += 1
            where = f"{sel} ({path}) x {storage}, batch {batch}: {got['lines']}"
            assert got["per_layer_step"] <= LAYER_STEP_ALLOWANCE.get(sel, 0.0), where
            assert got["per_forward"] <= (PER_FORWARD_PADDED if batch > 1 else 0.0), where
    assert ran, f"{selector}: every cell was refused, nothing was counted"


def test_the_counter_sees_a_read_back_in_a_layer():
    """The same count fails when a layer reads a value back: a ``bool(tensor)`` added to the dense store."""
    from kvcompress.storage.dense import DenseStore

    read = DenseStore.read

    def reading(self):
        out = read(self)
        bool(out[0].sum() > 0)
        return out

    DenseStore.read = reading
    try:
        got = SYNCS.count(MODEL, "sliding_window", {"name": "dense"}, 1)
    finally:
        DenseStore.read = read
    assert got["status"] == "ok" and got["per_layer_step"] >= 1.0, got
