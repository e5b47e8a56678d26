"""The one GPU run: every number the GPU path owes, from a single command of at most 10 minutes.

1. ``kernels``: the Triton kernel tests (``tests/kernels/test_triton_kernels.py``) on CUDA.
2. ``syncs``: steady-state decode of every main policy under ``torch.cuda.set_sync_debug_mode("error")``
   (``tiered`` under ``"warn"``, counted: it may read one small tensor per layer-step).
3. ``bench``: a random-weight model of Llama-3.1-8B's shape in bfloat16 at 8k and 32k tokens: prefill time,
   decode tokens/s and peak device memory for ``full``, int4, int2, ``snapkv`` 0.5, ``snapkv`` 0.5 over
   int4 and ``tiered`` (host tier), against transformers' ``DynamicCache``, ``QuantizedCache`` (HQQ backend,
   where ``hqq`` is installed) and ``DynamicCache(offloading=True)``.

One JSON record (written atomically after each part) and a printed table.

    python experiments/gpu/run.py --out experiments/gpu/runs/gpu_h200.json    # where a GPU is available
    python experiments/gpu/run.py --dry-run --out /tmp/gpu_dry.json           # the same code, CPU, tiny

The dry run (``tests/experiments/test_gpu_script.py``) uses a 2-layer model of the same head layout, 64- and
128-token contexts and 4 decode steps; its syncs part counts host-blocking operations with
``kvcompress.metrics.host_syncs`` instead of CUDA's debug mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcompress import build_cache, make_policy
from kvcompress.metrics.compression import attention_backends
from kvcompress.metrics.host_syncs import HostSyncs

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "tiered"))
from gpu_bench import LLAMA_31_8B  # noqa: E402  (the tiered GPU benchmark's Llama-3.1-8B shape)

LLAMA_8B = {k: v for k, v in LLAMA_31_8B.items() if k != "max_position_embeddings"}  # set per context
TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    vocab_size=512,
    rope_theta=500000.0,
)  # fmt: skip  (head_dim 64, GQA 4)
OURS = {  # name -> build_cache arguments
    "full": ("full", {}),
    "int4": ("quant", {"bits": 4}),
    "int2": ("quant", {"bits": 2}),
    "snapkv_0.5": ("snapkv", {"compression_ratio": 0.5}),
    "snapkv_0.5_int4": ("snapkv", {"compression_ratio": 0.5, "storage": {"name": "quant", "bits": 4}}),
    "tiered_host": ("tiered", {}),
}
DRY = {  # tiny contexts: a shorter exact window and smaller pages, so that each really compresses
    "int4": {"recent": 16, "group_size": 16},
    "int2": {"recent": 16, "group_size": 16},
    "snapkv_0.5_int4": {"storage": {"name": "quant", "bits": 4, "recent": 16, "group_size": 16}},
    "tiered_host": {"top_k_blocks": 3, "storage": {"name": "offload", "block_size": 8, "recent": 16,
                                                   "lru_pages": 4}},
}  # fmt: skip
# the main policies, each at its TEST_PARAMS so that it compresses within the check
SYNC_POLICIES = ("full", "quant", "sliding_window", "h2o", "tova", "snapkv", "block_sparse", "block_evict",
                 "low_rank", "tiered")  # fmt: skip


@dataclasses.dataclass
class Setup:
    device: str
    dtype: torch.dtype
    shape: dict
    contexts: tuple[int, ...]
    decode: int
    sync_prompt: int

    @classmethod
    def of(cls, dry: bool) -> Setup:
        if dry:
            return cls("cpu", torch.float32, TINY, (64, 128), 4, 96)
        return cls("cuda", torch.bfloat16, LLAMA_8B, (8192, 32768), 32, 512)


def model_of(setup: Setup, max_len: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**setup.shape, max_position_embeddings=max_len + 64, attn_implementation="sdpa")
    with torch.device(setup.device):
        model = LlamaForCausalLM(cfg).to(setup.dtype)
    return model.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- 1. kernels -------------------------------------------------------------------------------------------


def kernels(dry: bool) -> dict:
    if dry:
        return {"status": "skipped", "why": "dry run: make test runs them under Triton's interpreter"}
    test = "tests/kernels/test_triton_kernels.py"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return {"status": "passed" if done.returncode == 0 else "failed", "tail": tail}


# -- 2. host syncs ------------------------------------------------------------------------------------------


@torch.inference_mode()
def syncs(setup: Setup, model) -> dict:
    out = {}
    ids = torch.randint(2, 500, (1, setup.sync_prompt), generator=torch.Generator().manual_seed(1))
    for name in SYNC_POLICIES:
        try:
            out[name] = _sync_check(setup, model, name, ids.to(setup.device))
        except Exception as err:  # noqa: BLE001 - the record says what broke; the others still run
            out[name] = {"status": "error", "error": _describe(err)}
        print(f"syncs {name:>15}: {out[name]}", flush=True)
    return out


def _sync_check(setup: Setup, model, name: str, ids) -> dict:
    policy = make_policy(name)
    cache = build_cache(dataclasses.replace(policy, **type(policy).TEST_PARAMS), model)
    logits = model(ids, cache=cache).logits[:, -1:]
    for _ in range(2):
        logits = model(logits.argmax(-1), cache=cache).logits[:, -1:]
    nxt, steps = logits.argmax(-1), 8
    if setup.device != "cuda":
        with HostSyncs() as counted:
            for _ in range(steps):
                nxt = model(nxt, cache=cache).logits[:, -1:].argmax(-1)
        per = counted.in_layers / (steps * len(cache.layers))
        return {"status": "ok", "per_layer_step": per, "lines": dict(counted.lines.most_common(3))}
    mode = "warn" if name == "tiered" else "error"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            for _ in range(steps):
                nxt = model(nxt, cache=cache).logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = sum("synchroniz" in str(w.message) for w in caught)
    return {"status": "ok", "mode": mode, "per_layer_step": n / (steps * len(cache.layers)),
            "backends": attention_backends(cache)}  # fmt: skip


def _describe(err: Exception) -> str:
    tb = traceback.extract_tb(err.__traceback__)
    where = next(
        (f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "kvcompress" in f.filename), ""
    )
    return f"{type(err).__name__}: {str(err)[:240]} {where}".strip()


# -- 3. speed and memory ------------------------------------------------------------------------------------


def theirs(name: str, model):
    """transformers' own caches, or why one is unavailable."""
    if name == "DynamicCache":
        return DynamicCache(config=model.config)
    if name == "DynamicCache_offload":
        if model.device.type != "cuda":
            return "offloading moves layers between a GPU and the host: CUDA only"
        return DynamicCache(config=model.config, offloading=True)
    from transformers import QuantizedCache

    try:
        import hqq  # noqa: F401
    except ImportError:
        return "hqq is not installed"
    return QuantizedCache(backend="hqq", config=model.config, nbits=4)


@torch.inference_mode()
def bench(setup: Setup) -> list[dict]:
    rows = []
    model = model_of(setup, max(setup.contexts))
    for n in setup.contexts:
        ids = torch.randint(
            2, setup.shape["vocab_size"] - 1, (1, n), generator=torch.Generator().manual_seed(2)
        )
        ids = ids.to(setup.device)
        for name in [*OURS, "DynamicCache", "QuantizedCache_hqq4", "DynamicCache_offload"]:
            rows.append({"context": n, "cache": name, **_measure(setup, model, name, ids)})
            print(_bench_line(rows[-1]), flush=True)
    return rows


def _measure(setup: Setup, model, name: str, ids) -> dict:
    try:
        if name in OURS:
            policy, params = OURS[name]
            params = {**params, **DRY.get(name, {})} if setup.device == "cpu" else params
            cache = build_cache(policy, model, **params)
        else:
            cache = theirs(name, model)
            if isinstance(cache, str):
                return {"status": "unavailable", "why": cache}
        return _timed(setup, model, cache, ids)
    except Exception as err:  # noqa: BLE001 - one configuration's failure is recorded, the rest run
        return {"status": "error", "error": _describe(err)}
    finally:
        cache = None
        if setup.device == "cuda":
            torch.cuda.empty_cache()


def _timed(setup: Setup, model, cache, ids) -> dict:
    cuda = setup.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    _sync(setup.device)
    t0 = time.perf_counter()
    logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
    _sync(setup.device)
    prefill = time.perf_counter() - t0
    nxt = logits[:, -1:].argmax(-1)
    nxt = model(nxt, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)  # first step: warm
    _sync(setup.device)
    t0 = time.perf_counter()
    for _ in range(setup.decode):
        nxt = model(nxt, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    _sync(setup.device)
    decode = time.perf_counter() - t0
    row = {"status": "ok", "prefill_s": prefill, "decode_tok_s": setup.decode / decode}
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_over_weights_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    if hasattr(cache, "memory_bytes"):
        row["cache_bytes"] = cache.memory_bytes()
        row["backends"] = attention_backends(cache)
    else:  # transformers' caches: the tensors their layers hold (wherever they are)
        held = [getattr(layer, a, None) for layer in cache.layers for a in vars(layer)]
        row["cache_bytes"] = sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))
    return row


def _bench_line(r: dict) -> str:
    head = f"{r['context']:>6} {r['cache']:>20}"
    if r["status"] != "ok":
        return f"{head}  {r['status']}: {r.get('why') or r.get('error')}"
    peak = f" peak {r['peak_gib']:.1f} GiB" if "peak_gib" in r else ""
    return f"{head}  prefill {r['prefill_s']:.2f} s  decode {r['decode_tok_s']:.1f} tok/s{peak}"


def table(rows: list[dict]) -> str:
    lines = ["| context | cache | prefill s | decode tok/s | peak GiB | cache bytes |", "|" + "---|" * 6]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['context']} | {r['cache']} | {r['status']} | | | |")
            continue
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else ""
        cells = [r["context"], r["cache"], f"{r['prefill_s']:.2f}", f"{r['decode_tok_s']:.1f}", peak]
        lines.append("| " + " | ".join(map(str, [*cells, r.get("cache_bytes", "")])) + " |")
    return "\n".join(lines)


# -- the record ---------------------------------------------------------------------------------------------


def write(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the CPU, tiny shapes (what the tests run)")
    ap.add_argument("--out", type=Path, default=Path("outputs/gpu_run.json"))
    args = ap.parse_args(argv)
    setup = Setup.of(args.dry_run)
    if setup.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    env = {"torch": torch.__version__, "device": setup.device, "dry_run": args.dry_run}
    if setup.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    record = {"environment": env, "kernels": kernels(args.dry_run)}
    write(args.out, record)
    shape = TINY if args.dry_run else {**TINY, "num_hidden_layers": 4}
    small = model_of(dataclasses.replace(setup, shape=shape), setup.sync_prompt + 64)
    record["syncs"] = syncs(setup, small)
    del small
    write(args.out, record)
    record["bench"] = bench(setup)
    write(args.out, record)
    print(table(record["bench"]))
    return record


if __name__ == "__main__":
    main()
