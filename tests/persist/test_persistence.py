"""Snapshots and cache files over every selector x storage cell (and every other policy in conf/policy/):
restore and load give back the identical state, bit for bit, and the same next logits; loading into
another model, a file written by other code or a changed layer format is refused by name (more checks of
cache files: tests/persist/test_cache_file_checks.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import CELLS, IDS, POLICY_NAMES, build_or_refused, is_selector, make_tiny, small
from helpers import stream_logits

from kvcompress import build_cache, compress_context, load_cache, save_cache
from kvcompress.persist import HEADER_KEY, cache_state
from kvcompress.persist.config import policy_config, policy_from_saved
from kvcompress.storage.low_rank import calibration

MODEL = make_tiny("llama")
OTHERS = [n for n in POLICY_NAMES if not is_selector(n)]  # schedules, pyramidkv, storage presets
CASES = CELLS + [(n, None) for n in OTHERS]
CASE_IDS = IDS + OTHERS
IDS_48 = torch.randint(2, 95, (1, 48), generator=torch.Generator().manual_seed(1))


def filled(sel, var):
    """The cell's cache after 40 tokens in chunks of 7 and its context pass (kvzip), or None if refused."""
    cache = build_or_refused(sel, var, MODEL) if var is not None else build_cache(small(sel), MODEL)
    if cache is not None:
        stream_logits(MODEL, IDS_48[:, :40], cache, chunk=7)
        compress_context(MODEL, cache, IDS_48[:, :40])
    return cache


def assert_same_state(a, b) -> None:
    (tree_a, tensors_a), (tree_b, tensors_b) = cache_state(a), cache_state(b)
    assert tree_a == tree_b and tensors_a.keys() == tensors_b.keys()
    for name, t in tensors_a.items():
        assert t.dtype == tensors_b[name].dtype and torch.equal(t, tensors_b[name]), name
    assert a.get_seq_length() == b.get_seq_length() and a.memory_bytes() == b.memory_bytes()
    for x, y in zip(a.layers, b.layers, strict=True):  # kernels read constants in their own layout
        assert [t.stride() for t in x.store.fixed_tensors()] == [t.stride() for t in y.store.fixed_tensors()]


def _no_calibration(*args, **kwargs):
    raise AssertionError("load_cache ran a calibration pass: the file holds the calibrated bases")


@pytest.mark.parametrize("sel,var", CASES, ids=CASE_IDS)
def test_save_and_load_round_trip_bit_exactly(sel, var, tmp_path, monkeypatch):
    cache = filled(sel, var)
    if cache is None:
        return
    save_cache(cache, tmp_path / "cache.safetensors")
    monkeypatch.setattr(calibration, "calibrate", _no_calibration)
    loaded = load_cache(tmp_path / "cache.safetensors", MODEL)
    assert loaded.policy.describe() == cache.policy.describe()
    assert_same_state(cache, loaded)
    more = IDS_48[:, 40:]
    assert torch.equal(stream_logits(MODEL, more, loaded, 1), stream_logits(MODEL, more, cache, 1))
    assert_same_state(cache, loaded)


@pytest.mark.parametrize("sel,var", CASES, ids=CASE_IDS)
def test_restore_returns_to_the_snapshot_exactly(sel, var):
    cache = filled(sel, var)
    if cache is None:
        return
    snap, twin = cache.snapshot(), copy.deepcopy(cache)
    first = stream_logits(MODEL, IDS_48[:, 40:], cache, 1)  # a question and its answer
    cache.restore(snap)
    assert_same_state(cache, twin)
    assert torch.equal(stream_logits(MODEL, IDS_48[:, 40:], cache, 1), first)
    cache.restore(snap)  # the snapshot is still intact for the next question
    assert_same_state(cache, twin)
    for layer, copied in zip(cache.layers, snap.layers, strict=True):
        assert layer.policy is copied.policy and layer is not copied  # constants shared, state not
        assert all(
            x is y for x, y in zip(layer.store.fixed_tensors(), copied.store.fixed_tensors(), strict=True)
        )


def test_policy_config_rebuilds_every_policy():
    for name in POLICY_NAMES:
        policy = small(name)
        rebuilt = policy_from_saved(json.loads(json.dumps(policy_config(policy))))
        assert rebuilt.describe() == policy.describe(), name


def _rewrite_header(src, dst, change) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        header = json.loads(f.metadata()[HEADER_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    change(header)
    save_file(tensors, str(dst), metadata={HEADER_KEY: json.dumps(header)})


def test_refuses_another_model_other_code_and_a_changed_format(tmp_path):
    cache = filled("h2o", "dense")
    path = tmp_path / "c.safetensors"
    save_cache(cache, path)
    with pytest.raises(ValueError, match="model mismatch: .* 'llama' model .* 'qwen2' model"):
        load_cache(path, make_tiny("qwen2"))
    other = make_tiny("llama")
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # same architecture, other weights
    with pytest.raises(ValueError, match="model mismatch"):
        load_cache(path, other)
    bad = tmp_path / "bad.safetensors"
    _rewrite_header(path, bad, lambda h: h["code"].update({"kvcompress.persist.state": "0" * 16}))
    with pytest.raises(
        ValueError, match=r"layout was written by other code: kvcompress.persist.state \(0{16} in the"
    ):
        load_cache(bad, MODEL)
    _rewrite_header(path, bad, lambda h: h["layers"][1]["state"].pop("acc"))
    with pytest.raises(ValueError, match=r"format mismatch: .*bad.safetensors: layer 1 .* missing \['acc'\]"):
        load_cache(bad, MODEL)
    _rewrite_header(path, bad, lambda h: h["policy_config"].update(_target_="os.system"))
    with pytest.raises(ValueError, match=r"'os.system', which is neither a kvcompress class .* refused"):
        load_cache(bad, MODEL)
