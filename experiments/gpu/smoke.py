"""First contact with a GPU: every selector x storage cell on a random Llama-shaped model in bf16 and fp16.

For each cell: does prefill + decode run on the device, are the logits finite, which attention backends ran,
how many host synchronisations each steady-state decode step makes (``torch.cuda.set_sync_debug_mode``,
counted per layer-step and located by the line that triggered them), the decode step time, the cache bytes,
and the first decode step's logits against ``full``'s. One JSON record and a printed table.

    python experiments/gpu/smoke.py --out outputs/gpu_smoke.json      # where a GPU is available

On a CPU (``--device cpu``) the same cells run without sync counts: the CPU test checks the script itself.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcompress import build_cache, known_policies, make_policy
from kvcompress.core.cache import known_storages
from kvcompress.core.registry import make_storage
from kvcompress.metrics.compression import attention_backends
from kvcompress.selectors import SchedulePolicy, StoragePreset


def model_of(device: str, dtype: torch.dtype, head_dim: int, layers: int) -> LlamaForCausalLM:
    """A random Llama with GQA (8 query heads over 2 KV heads), ``head_dim`` per head."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=8 * head_dim, intermediate_size=16 * head_dim, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
        pad_token_id=0, eos_token_id=511, bos_token_id=1, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def cells(only: list[str] | None = None) -> list[tuple[str, str, dict]]:
    """(selector, storage variant, storage params): every selector (or those in ``only``) with its test
    parameters over every storage variant each storage declares; refused pairs are reported as such."""
    kinds = (StoragePreset, SchedulePolicy)
    selectors = [n for n in known_policies() if not isinstance(make_policy(n), kinds) and n in (only or [n])]
    variants = [
        (f"{name}{i or ''}", {"name": name, **p})
        for name in known_storages()
        for i, p in enumerate(type(make_storage(name)).TEST_PARAMS)
    ]
    return [(sel, var, params) for sel in selectors for var, params in variants]


RATIO_PATHS = {  # a selector's other way of sizing what it keeps or reads: a ratio of the tokens seen
    "compression_ratio": {"budget": None, "compression_ratio": 0.5},
    "read_ratio": {"read_ratio": 0.5},
}


def budget_paths(sel: str) -> list[str]:
    """``fixed`` (the class's ``TEST_PARAMS``), for a selector sized by a ratio too ``ratio``, and for one
    whose test parameters evict at every step ``prefill`` (``evict_at: prefill``: decode steps append)."""
    fields = {f.name for f in dataclasses.fields(make_policy(sel))}
    paths = ["fixed", *(["ratio"] if fields & set(RATIO_PATHS) else [])]
    return paths + (["prefill"] if policy_of(sel, {"name": "dense"}).evicts == "always" and
                    "evict_at" in fields else [])  # fmt: skip


def policy_of(sel: str, params: dict, path: str = "fixed"):
    """Selector ``sel`` at its test parameters over storage ``params``; ``path="ratio"`` sizes it by a ratio
    (``RATIO_PATHS``) instead of its test parameters' fixed budget."""
    policy = make_policy(sel)
    policy = dataclasses.replace(policy, **type(policy).TEST_PARAMS)
    fields = {f.name for f in dataclasses.fields(policy)}
    if path == "ratio":
        for name, change in RATIO_PATHS.items():
            if name in fields:
                policy = dataclasses.replace(policy, **change)
    if path == "prefill":  # evicts the prompt only; decode steps append
        policy = dataclasses.replace(
            policy, evict_at="prefill", **({"slack": None} if "slack" in fields else {})
        )
    return dataclasses.replace(policy, storage=make_storage(dict(params)))


class SyncCounter:
    """Host synchronisations while active (CUDA's sync debug mode, warnings counted by source line)."""

    def __init__(self, on: bool):
        self.on, self.lines = on, collections.Counter()

    def __enter__(self):
        if self.on:
            self._w = warnings.catch_warnings(record=True)
            self.caught = self._w.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self._w.__exit__(*exc)
            for w in self.caught:
                if "synchroniz" in str(w.message):
                    self.lines[f"{Path(w.filename).name}:{w.lineno}"] += 1

    @property
    def total(self) -> int:
        return sum(self.lines.values())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def run_cell(model, policy, ids: torch.Tensor, decode: int, device: str) -> dict:
    """Prefill ``ids`` in one forward, then ``decode`` greedy one-token steps; the last half of the steps are
    the steady state whose syncs and time are counted."""
    cache = build_cache(policy, model)
    logits = model(ids, cache=cache, use_cache=True).logits[:, -1:]
    first = None
    warm = decode // 2
    step_s = []
    syncs = SyncCounter(device.startswith("cuda"))
    for i in range(decode):
        token = logits.argmax(-1)
        if i < warm:
            logits = model(token, cache=cache, use_cache=True).logits[:, -1:]
        else:
            _sync(device)
            t0 = time.perf_counter()
            with syncs:
                logits = model(token, cache=cache, use_cache=True).logits[:, -1:]
            _sync(device)
            step_s.append(time.perf_counter() - t0)
        if first is None:
            first = logits.float().cpu()
    layer_steps = (decode - warm) * len(cache.layers)
    return {
        "finite": bool(torch.isfinite(logits).all()),
        "first_logits": first,
        "backends": attention_backends(cache),
        "syncs_per_layer_step": syncs.total / layer_steps,
        "sync_lines": dict(syncs.lines.most_common(6)),
        "decode_ms": 1e3 * sorted(step_s)[len(step_s) // 2],
        "cache_bytes": cache.memory_bytes(),
    }


def one(model, sel, var, params, ids, decode, device, full_first) -> dict:
    row = {"selector": sel, "storage": var}
    try:
        policy = policy_of(sel, params)
        result = run_cell(model, policy, ids, decode, device)
    except ValueError as err:  # build_cache's refusals name the pair and the fix
        return row | {"status": "refused" if "cannot work" in str(err) else "error", "error": str(err)[:300]}
    except Exception as err:  # noqa: BLE001 - the record says what broke, the sweep goes on
        tb = traceback.extract_tb(err.__traceback__)[-1]
        where = f"{Path(tb.filename).name}:{tb.lineno}"
        return row | {"status": "error", "error": f"{type(err).__name__}: {str(err)[:300]} at {where}"}
    first = result.pop("first_logits")
    if full_first is not None:
        result["first_step_max_abs_vs_full"] = float((first - full_first).abs().max())
    return row | {"status": "ok", **result}


def sweep(device: str, dtype: torch.dtype, head_dim: int, prefill: int, decode: int, only=None) -> list[dict]:
    model = model_of(device, dtype, head_dim, layers=4)
    ids = torch.randint(2, 500, (1, prefill), generator=torch.Generator().manual_seed(1)).to(device)
    full = run_cell(model, make_policy("full"), ids, decode, device)["first_logits"]
    rows = []
    for sel, var, params in cells(only):
        row = one(model, sel, var, params, ids, decode, device, full)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim, **row})
        print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    head = f"{r['dtype']:>8} {r['head_dim']:>3} {r['selector']:>18} {r['storage']:>10}"
    if r["status"] != "ok":
        return f"{head}  {r['status']}: {r['error']}"
    return (
        f"{head}  ok finite={r['finite']} "
        f"syncs/layer-step={r['syncs_per_layer_step']:.2f} {r['decode_ms']:.2f} ms/step "
        f"backends={r['backends']} d_full={r.get('first_step_max_abs_vs_full', 0):.3g} {r['sync_lines']}"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--only", default="", help="comma-separated selectors (default: all)")
    ap.add_argument("--out", default="outputs/gpu_smoke.json")
    args = ap.parse_args(argv)
    env = {"torch": torch.__version__, "device": args.device, "python": sys.version.split()[0]}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    rows, only = [], [s for s in args.only.split(",") if s]
    for dtype in args.dtypes.split(","):
        for hd in map(int, args.head_dims.split(",")):
            rows += sweep(args.device, getattr(torch, dtype), hd, args.prefill, args.decode, only)
            counts = write(Path(args.out), env, vars(args), rows)  # per sweep: a cut run keeps its rows
    print(json.dumps({"environment": env, "status_counts": counts}))


def write(out: Path, env: dict, args: dict, rows: list[dict]) -> dict:
    """The record, written atomically; returns the count of cells per status."""
    counts = dict(collections.Counter(r["status"] for r in rows))
    record = {"environment": env, "args": args, "status_counts": counts, "cells": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(out)
    return counts


if __name__ == "__main__":
    main()
