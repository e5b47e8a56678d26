"""Calibration files are keyed by the code that computes the moments and by what they store, so a change to
that code never reuses stale moments; a stale, malformed or unreadable file is never used: the moments are
computed again (with a warning naming the file and the fault) and the file replaced."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from kvcompress.core import sources
from kvcompress.storage.low_rank import calibration

MODEL = make_tiny("llama")  # 3 layers, 2 KV heads of 16 channels


@pytest.mark.parametrize(
    "module",
    ["kvcompress.storage.low_rank.calibration_queries", "kvcompress.core.layer", "kvcompress.storage.dense",
     "kvcompress.storage.rope", "kvcompress.core.attention", "kvcompress.storage.low_rank.calibration_text"],
)  # fmt: skip
def test_a_change_to_the_code_of_the_moments_computes_them_again(module, tmp_path, monkeypatch):
    first = calibration.calibrate(MODEL, "random", 32, tmp_path)
    assert calibration.calibrate(MODEL, "random", 32, tmp_path)["source"] == "memory"
    real = sources.module_digest
    monkeypatch.setattr(sources, "module_digest", lambda name: "f" * 16 if name == module else real(name))
    again = calibration.calibrate(MODEL, "random", 32, tmp_path)  # as if ``module`` changed since then
    assert again["source"] == "computed" and again["ident"]["code"] != first["ident"]["code"]
    assert len(list(tmp_path.glob("kv-moments-*.pt"))) == 2


def _stale(path):
    saved = torch.load(path, weights_only=True)
    saved["ident"] = {**saved["ident"], "code": "0" * 16}  # as written under another key by other code
    torch.save(saved, path)


def _wrong_shape(path):
    saved = torch.load(path, weights_only=True)
    saved["values"] = saved["values"][:, :8, :8].clone()
    torch.save(saved, path)


def _truncated(path):
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_stale, r"it was computed for another model, text or calibration code \(stale\)"),
        (_wrong_shape, r"its 'values' is torch.float32 \[3, 8, 8\], not float32 \[3, 32, 32\]"),
        (_truncated, r"it cannot be read \(RuntimeError: .*\)"),
    ],
)
def test_a_stale_malformed_or_unreadable_file_is_not_used(damage, says, tmp_path, monkeypatch):
    first = calibration.calibrate(MODEL, "random", 32, tmp_path)
    (path,) = tmp_path.glob("kv-moments-*.pt")
    damage(path)
    monkeypatch.setattr(calibration, "_MEMO", {})  # a new process: only the file is left
    with pytest.warns(UserWarning, match=rf"calibration file .*{path.name} is not used: {says}; computing"):
        again = calibration.calibrate(MODEL, "random", 32, tmp_path)
    assert again["source"] == "computed" and torch.equal(again["values"], first["values"])
    monkeypatch.setattr(calibration, "_MEMO", {})
    reread = calibration.calibrate(MODEL, "random", 32, tmp_path)  # the file was replaced by a good one
    assert reread["source"] == "disk" and torch.equal(reread["values"], first["values"])
