"""The benchmark's bookkeeping (ratios, overhead, bytes) and the memory guard, on a tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from kvcompress.harness.guard import ResourceError, check_fits, estimate_bytes
from kvcompress.harness.tasks import bench


class CharTokenizer:
    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 90 + 2 for c in text]]))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox jumps over the lazy dog " * 20)
    return str(path)


def test_bench_rows_ratios_and_bytes(llama, text_file):
    cfg = OmegaConf.create(
        dict(
            policies=["sliding_window"],
            policy_overrides={"sliding_window": {"sink_tokens": 2, "window": 14}},
            peers=["dynamic", "hf_quantized_fp8"],
            lengths=[32, 64],
            text=text_file,
            decode_tokens=4,
            warmup=0,
            repeats=1,
            progress=False,
        )
    )
    rows = bench.run(llama, CharTokenizer(), None, cfg)["rows"]
    by = {(r["cache"], r["context"]): r for r in rows}
    assert set(by) == {
        (c, n) for c in ("full", "sliding_window", "dynamic", "hf_quantized_fp8") for n in (32, 64)
    }
    assert by[("full", 64)]["decode_vs_full"] == 1.0
    # after a 64-token prompt and 4 decode steps the window holds 2 + 14 tokens, full holds 68
    assert by[("sliding_window", 64)]["bytes_vs_full"] == pytest.approx(16 / 68)
    assert by[("dynamic", 64)]["bytes_vs_full"] == pytest.approx(1.0)
    assert by[("hf_quantized_fp8", 64)]["bytes_vs_full"] < 0.3
    assert all(0 <= r["policy_overhead"] < 1 for r in rows)
    assert by[("dynamic", 32)]["policy_overhead"] == 0  # transformers' caches run none of our code
    assert by[("dynamic", 64)]["decode_vs_dynamic"] == 1.0
    assert by[("full", 64)]["decode_vs_dynamic"] == pytest.approx(
        by[("full", 64)]["decode_tok_s"] / by[("dynamic", 64)]["decode_tok_s"]
    )
    assert by[("sliding_window", 64)]["bytes_vs_dynamic"] == pytest.approx(16 / 68, rel=0.01)
    assert all(r["peak_rss_mb"] > 0 and r["peak_device_mb"] is None for r in rows)  # CPU: no device peak


def test_scaling_fits_decode_ms_per_1k_tokens_of_context():
    rows = [
        {"cache": "a", "context": n, "decode_tok_s": 1000 / (5 + 2 * n / 1000)} for n in (1000, 2000, 4000)
    ]
    rows.append({"cache": "b", "context": 1000, "decode_tok_s": 10.0})  # one point: no line
    (fit,) = bench.scaling(rows)
    assert fit["cache"] == "a" and fit["fit_points"] == 3
    assert fit["decode_ms_per_1k_context"] == pytest.approx(2.0)
    assert fit["decode_ms_per_token_at_1k"] == pytest.approx(7.0)


def test_bench_rejects_unknown_peer(llama, text_file):
    cfg = OmegaConf.create(dict(policies=["full"], peers=["nope"], lengths=[8], text=text_file))
    with pytest.raises(ValueError, match="task.peers"):
        bench.run(llama, CharTokenizer(), None, cfg)


def test_guard_estimate_scales_with_tokens_and_refuses_huge_runs(llama):
    small, big = estimate_bytes(llama, 100), estimate_bytes(llama, 200)
    assert big["kv_cache"] == 2 * small["kv_cache"]
    cfg = llama.config
    assert small["kv_cache"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 16 * 100 * 4
    with pytest.raises(ResourceError, match="GiB"):
        check_fits(llama, 10**9)
    assert check_fits(llama, 100)["total"] == small["total"]
