"""The lm-eval adapter on the embedded default: `full` reproduces lm-eval's `hf`, eviction changes it."""

from __future__ import annotations

import pytest

from kvcompress.resources.models import default_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_embedded_model_full_matches_hf_and_window_differs():
    lm_eval = pytest.importorskip("lm_eval")
    import kvcompress.eval.adapter  # noqa: F401  (registers model="kvcompress")
    from kvcompress.eval import task_manager

    common = {"pretrained": str(default_model_dir()), "device": "cpu", "dtype": "float32", "max_length": 256}
    tm = task_manager(["kvc_essays_ppl"])

    def bpb(model, **args):
        out = lm_eval.simple_evaluate(model=model, model_args={**common, **args}, tasks=["kvc_essays_ppl"],
                                      task_manager=tm, limit=1, bootstrap_iters=0)  # fmt: skip
        return out["results"]["kvc_essays_ppl"]["bits_per_byte,none"]

    stock = bpb("hf")
    assert bpb("kvcompress", policy="full", chunk_size=64) == pytest.approx(stock, rel=1e-3)
    window = bpb("kvcompress", policy="sliding_window", sink_tokens=4, window=60, chunk_size=64)
    assert window > stock * 1.005  # a 64-token cache loses context the 256-token window had (bits/byte)
