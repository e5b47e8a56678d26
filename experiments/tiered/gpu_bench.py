"""Tiered vs full decode on a random-weight Llama-3.1-8B-shaped model in bf16 at a 32k context (one GPU).

Prepared for a single short GPU run (under 10 minutes on one H100/H200-class GPU); never needed by CI.
Reports per cache: prefill seconds, decode tokens/s (after a warm-up, with CUDA synchronisation), device
cache bytes, host/disk bytes, host-to-device bytes and pages fetched per decode step (summed over layers),
LRU hit rate, and peak device memory (``torch.cuda.max_memory_allocated``, weights included, reset per run).

    OMP_NUM_THREADS=8 PYTHONPATH=. python experiments/tiered/gpu_bench.py --out $OUT/gpu_bench.json

Random weights: the speed and bytes are the model's shape's, the selections are not a real model's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)


SMOKE = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64
)


def build_model(layers: int, device: str, smoke: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {**LLAMA_31_8B, **(SMOKE if smoke else {}), "num_hidden_layers": layers}
    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for p in model.parameters():  # small weights keep bf16 activations finite through 32 random layers
        p.data.normal_(0, 0.02)
    return model.eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def one_run(model, ids, make_cache, decode_tokens: int, warmup: int, chunk: int) -> dict:
    from kvcompress.metrics.memory import tier_summary

    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = make_cache()
    sync()
    t0 = time.perf_counter()
    for s in range(0, ids.shape[1], chunk):  # every cache prefills in the same chunks (32k logits: 8 GB)
        logits = model(ids[:, s : s + chunk], cache=cache, logits_to_keep=1).logits
    sync()
    prefill = time.perf_counter() - t0
    nxt = logits[:, -1:].argmax(-1)
    for _ in range(warmup):
        nxt = model(nxt, cache=cache).logits[:, -1:].argmax(-1)
    before, fetched = tier_summary(cache.stats()), _fetched(cache)
    sync()
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        nxt = model(nxt, cache=cache).logits[:, -1:].argmax(-1)
    sync()
    decode = time.perf_counter() - t1
    stats = tier_summary(cache.stats())
    return {
        "prefill_s": prefill,
        "decode_tok_s": decode_tokens / decode,
        "cache_device_bytes": cache.memory_bytes(),
        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        **{k: stats.get(k) for k in ("host_bytes", "disk_bytes", "lru_hit_rate")},
        "h2d_bytes_per_decode_step": (_fetched(cache) - fetched) / decode_tokens,  # all layers
        "h2d_bytes_per_step_all": stats.get("bytes_fetched_per_step"),  # prefill chunks included
        "before_decode": before,
    }


def _fetched(cache) -> int:
    return sum(s.get("bytes_fetched", 0) for s in cache.stats())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--tiers", default="host,disk")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a small model of the same layout (CPU check)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    args = ap.parse_args()
    from kvcompress import build_cache

    model = build_model(args.layers, args.device, args.smoke)
    ids = torch.randint(0, LLAMA_31_8B["vocab_size"], (1, args.context), device=args.device)
    caches = {"full": lambda: build_cache("full", model)}
    folder = tempfile.mkdtemp(prefix="kvc-tiered-")
    for tier in args.tiers.split(","):
        storage = {"name": "offload", "tier": tier, "dir": folder}
        caches[f"tiered_{tier}"] = lambda s=storage: build_cache(
            "tiered", model, prefill_chunk=args.prefill_chunk, storage=s
        )
    rows = {}
    for name, make in caches.items():
        rows[name] = one_run(model, ids, make, args.decode_tokens, args.warmup, args.prefill_chunk)
        rows[name]["decode_vs_full"] = rows[name]["decode_tok_s"] / rows["full"]["decode_tok_s"]
        rows[name]["cache_vs_full"] = rows[name]["cache_device_bytes"] / rows["full"]["cache_device_bytes"]
        print(name, json.dumps(rows[name]), flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    record = {"args": vars(args), "device": device, "torch": torch.__version__}
    with open(args.out + ".tmp", "w") as f:
        json.dump({**record, "rows": rows}, f, indent=1)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
