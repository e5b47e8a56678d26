"""GPU decode benchmark: a random-weight model of Llama-3.1-8B's shape in bf16, at 8k and 32k.

Prepared for a machine with one CUDA GPU; not run in CI. Reports decode tokens/s, prefill seconds and peak
device memory for ``full``, kvcompress int4 and int2 (the fused attention from codes, compiled), SnapKV at
compression 0.5, transformers' ``DynamicCache`` and ``QuantizedCache`` (each backend that is installed:
fp8 needs nothing, quanto/hqq need their packages). Random weights make the text meaningless but the work
per step is the real model's. Stops starting new runs after ``BUDGET_S`` seconds so it fits 10 minutes.

    PYTHONPATH=$PWD python experiments/fused/gpu_bench.py experiments/fused/gpu_bench.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache, QuantizedCache

from kvcompress import build_cache
from kvcompress.core import attention
from kvcompress.resources.files import write_text_atomic

BUDGET_S = 480
LENGTHS = (8192, 32768)
DECODE, WARMUP = 32, 4
OURS = {
    "full": ("full", {}),
    "int4": ("quant", {"bits": 4, "backend": "torch"}),  # the torch.compile'd tensor form (from 1024 tokens)
    "int2": ("quant", {"bits": 2, "backend": "torch"}),
    "snapkv_0.5": ("snapkv", {"compression_ratio": 0.5}),
}
PEERS = {"hf_dynamic": None, "hf_quantized_fp8": "fp8", "hf_quantized_quanto_int4": "quanto"}


def llama_8b_shape() -> LlamaForCausalLM:
    """Llama-3.1-8B's configuration with random weights, bf16, on the GPU (about 16 GB)."""
    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def make_cache(model, name: str):
    if name in OURS:
        attention.install(model)
        policy, params = OURS[name]
        return build_cache(policy, model, **params)
    model.set_attn_implementation(model.config.kvcompress_backend)
    if PEERS[name] is None:
        return DynamicCache(config=model.config)
    return QuantizedCache(PEERS[name], model.config)


@torch.inference_mode()
def measure(model, ids, name: str) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cache = make_cache(model, name)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    nxt = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    for _ in range(WARMUP):  # includes compiling the fused path for this shape bucket
        nxt = model(nxt, cache=cache, use_cache=True).logits.argmax(-1)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(DECODE):
        nxt = model(nxt, cache=cache, use_cache=True).logits.argmax(-1)
    torch.cuda.synchronize()
    decode = time.perf_counter() - t1
    return {
        "prefill_s": prefill, "decode_tok_s": DECODE / decode,
        "peak_mem_over_weights_gb": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
    }  # fmt: skip


def main(out: str) -> None:
    start = time.perf_counter()
    model = llama_8b_shape()
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "decode_tokens": DECODE,
        "rows": [],
    }
    for length in LENGTHS:
        ids = torch.randint(0, 128000, (1, length), device="cuda")
        for name in [*OURS, *PEERS]:
            if time.perf_counter() - start > BUDGET_S:
                record["rows"].append({"cache": name, "context": length, "skipped": "time budget"})
                continue
            try:
                row = measure(model, ids, name)
            except Exception as err:  # a missing backend (quanto), or out of memory: recorded, not fatal
                row = {"error": f"{type(err).__name__}: {err}"[:300]}
            record["rows"].append({"cache": name, "context": length, **row})
            print(record["rows"][-1], flush=True)
            write_text_atomic(Path(out), json.dumps(record, indent=1))
    full = {r["context"]: r for r in record["rows"] if r["cache"] == "full" and "decode_tok_s" in r}
    for r in record["rows"]:
        if "decode_tok_s" in r and r["context"] in full:
            r["decode_vs_full"] = r["decode_tok_s"] / full[r["context"]]["decode_tok_s"]
    write_text_atomic(Path(out), json.dumps(record, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "experiments/fused/gpu_bench.json")
