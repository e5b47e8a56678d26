"""Interleaved decode speed of compressed caches vs ``full`` on the embedded model.

A prefill per contender, except that storage-only contenders (whose state after a prefill depends only on
the keys and values, not on attention scores: quant, low-rank, Quest) are filled by replaying ``full``'s
prefill keys/values through their own ``update``: the state a model prefill gives them, without paying a
4k-token forward each on a starved shared CPU (their ``prefill_s`` is then the replay's). Then a few
warm-up decode steps (which include any ``torch.compile``), then ``rounds`` rounds in which every
contender decodes ``steps`` tokens in turn: the ratio to ``full`` is taken within each round (same machine
load) and reported as median and range. Policy overhead is ``PolicyTimer`` seconds over decode seconds.
The process's CPU time is recorded too (``vs_full_cpu``): on a machine shared with higher-priority jobs,
wall time mostly measures preemption, CPU time what the decode itself cost (one thread).

With ``--paired`` each contender's ratio is taken against a ``full`` measurement made just before it (so
``full`` decodes once per contender and round), not against the round's single ``full`` measurement a
minute earlier: load that drifts within a round then cancels. ``full`` is put back to one snapshot before
each measurement (plus one untimed step that re-owns its buffers), so every ``full`` sample decodes at the
same context; the contenders' own contexts grow by ``rounds x steps`` tokens, a bias against them.
Usage: ``python experiments/fused/decode_speed.py OUT.json LENGTH [ROUNDS] [STEPS] [--paired] [NAME ...]``
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvcompress import build_cache
from kvcompress.core import attention
from kvcompress.core.cache import held_bytes
from kvcompress.core.profiling import timing
from kvcompress.harness.tasks.perplexity import text_tokens
from kvcompress.metrics.memory import read_summary
from kvcompress.resources.files import write_text_atomic
from kvcompress.resources.models import load_model
from kvcompress.runtime.context_pass import after_prefill

CONTENDERS = {
    "full": ("full", {}),
    # ``full`` over the first half of the prompt only: what any ratio-0.5 selector reads at best, so its
    # ratio to ``full`` bounds theirs (the weights and the rest of the step cost the same)
    "full_half": ("full", {}),
    # the torch backend's tensor form, compiled from 1024 quantized tokens: what "auto" was when measured
    "int4": ("quant", {"bits": 4, "backend": "torch"}),
    "int8": ("quant", {"bits": 8, "backend": "torch"}),
    "int4_unfused": ("quant", {"bits": 4, "backend": "dense"}),
    "int4_kernel": ("quant", {"bits": 4, "backend": "cpu"}),  # the C++ kernel: what "auto" is on a CPU now
    # int4 with per-token key groups (the layout eviction over int4 needs), backend auto: the C++ kernel
    "int4_token": ("quant", {"bits": 4, "key_axis": "token"}),
    "int8_kernel": ("quant", {"bits": 8, "backend": "cpu"}),
    "int2_kernel": ("quant", {"bits": 2, "backend": "cpu"}),
    "block_sparse_0.25": ("block_sparse", {"read_ratio": 0.25}),  # auto: pages read in place (C++ kernel)
    "block_sparse_0.25_gather": ("block_sparse", {"read_ratio": 0.25, "backend": "dense"}),
    "low_rank_32": ("low_rank", {"rank": 32}),  # backend auto: latent values, pre-RoPE keys rebuilt
    "low_rank_32_head": ("low_rank", {"rank": 32, "basis": "head"}),  # per-head bases: a third of the rebuild
    "snapkv_0.5": ("snapkv", {"compression_ratio": 0.5}),
    # the other eviction policies at ratio 0.5 (the window at half of a 4k prompt)
    **{
        f"{p}_0.5": (p, {"compression_ratio": 0.5})
        for p in ("h2o", "tova", "pyramidkv", "block_evict", "expected_attention", "kvzip", "keydiff", "rkv")
    },  # fmt: skip
    "sliding_window_2048": ("sliding_window", {"window": 2048}),
    # transformers' own DynamicCache, decoding with the model's own attention (kvcompress detached)
    "dynamic": (None, {}),
    # score-based eviction over int4 codes (per-token key groups: per-channel ones are refused there)
    **{
        f"{p}_0.5_int4": (
            p,
            {"compression_ratio": 0.5, "storage": {"name": "quant", "bits": 4, "key_axis": "token"}},
        )
        for p in ("h2o", "tova")
    },  # fmt: skip
    # low_rank: reconstruct-then-SDPA (dense) vs attention in the latent space (torch), pre-/post-RoPE keys
    "low_rank_32_off": ("low_rank", {"rank": 32, "backend": "dense"}),
    "low_rank_32_post": ("low_rank", {"rank": 32, "keys": "post_rope", "backend": "torch"}),
    "low_rank_32_post_off": ("low_rank", {"rank": 32, "keys": "post_rope", "backend": "dense"}),
}
REPLAYABLE = {"int4", "int8", "int4_unfused", "int4_token", "block_sparse_0.25", "block_sparse_0.25_gather"}
REPLAYABLE |= {n for n in CONTENDERS if "low_rank" in n or "kernel" in n}


@torch.inference_mode()
def prepare(model, tokenizer, ids, name, reference=None):
    """A contender's cache after the prompt; ``reference``: the ``full`` state to replay, when allowed."""
    policy, params = CONTENDERS[name]
    ids = ids[:, : ids.shape[1] // 2] if name == "full_half" else ids
    cache = DynamicCache(config=model.config) if policy is None else build_cache(policy, model, **params)
    t0 = time.perf_counter()
    if reference is not None and name in REPLAYABLE:
        for layer, ref in zip(cache.layers, reference["cache"].layers, strict=True):
            layer.update(*ref.store.read())  # the keys/values the model's prefill produced
        nxt = reference["first"]
    else:
        with own_attention(model, cache):
            logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        after = after_prefill(model, tokenizer)
        if after is not None:
            after(cache, ids)
        nxt = logits.argmax(-1)
    prefill = time.perf_counter() - t0
    first = nxt
    replayed = reference is not None and name in REPLAYABLE
    return {
        "cache": cache, "next": nxt, "first": first, "prefill_s": prefill, "replayed": replayed,
        "bytes": held_bytes(cache),
    }  # fmt: skip


@contextlib.contextmanager
def own_attention(model, cache):
    """For a cache that is not kvcompress's (``dynamic``): the model's own attention implementation, as a
    user of transformers runs it; kvcompress's again afterwards (outside any timing)."""
    if hasattr(cache, "memory_bytes"):
        yield
        return
    attention.uninstall(model)
    try:
        yield
    finally:
        attention.install(model)


@torch.inference_mode()
def warm_up(model, state, steps: int = 3) -> None:
    """Decode steps outside the timing: the fused path compiles here, once for this shape bucket."""
    nxt = state["next"]
    with own_attention(model, state["cache"]):
        for _ in range(steps):
            nxt = model(nxt, cache=state["cache"], use_cache=True).logits[:, -1:].argmax(-1)
    state["next"] = nxt


@torch.inference_mode()
def decode(model, state, steps: int) -> tuple[float, float]:
    nxt, cache = state["next"], state["cache"]
    with own_attention(model, cache), timing() as timer:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    state["next"] = nxt
    return steps / seconds, timer.seconds / seconds, steps / cpu


def cpu_flags() -> dict:
    """The CPU's model name and whether it has AVX-512 (the C++ kernels' fastest build needs it): speeds
    from machines that differ here are not comparable."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    model = names[0] if names else ""
    return {"cpu_model": model, "avx512f": " avx512f" in info}


def ratios(runs: list, fulls: list, index: int) -> list[float]:
    """Each run's ``index`` field (0: tok/s by wall time, 2: by CPU time) over its paired ``full`` run's."""
    return [run[index] / full[index] for run, full in zip(runs, fulls, strict=True)]


def summarise(samples: dict, states: dict, fulls: dict | None = None) -> dict:
    """Per contender its medians and ranges; ``fulls[name]``: the ``full`` runs its rounds are divided by
    (paired mode), else the round's one ``full`` run."""
    out = {}
    for name, runs in samples.items():
        base = runs if name == "full" else samples["full"] if fulls is None else fulls[name]
        ratio, cpu = ratios(runs, base, 0), ratios(runs, base, 2)
        toks, over = [r[0] for r in runs], [r[1] for r in runs]
        out[name] = {
            "decode_tok_s_median": statistics.median(toks), "decode_tok_s_min": min(toks),
            "decode_tok_s_max": max(toks), "vs_full_median": statistics.median(ratio),
            "vs_full_min": min(ratio), "vs_full_max": max(ratio),
            "cpu_tok_s_median": statistics.median(r[2] for r in runs),
            "vs_full_cpu_median": statistics.median(cpu),
            "vs_full_cpu_min": min(cpu), "vs_full_cpu_max": max(cpu),
            "policy_overhead_median": statistics.median(over), "prefill_s": states[name]["prefill_s"],
            "cache_bytes": states[name]["bytes"], "prefill_replayed": states[name]["replayed"],
            "reads": read_summary(_stats(states[name]["cache"])),  # block_sparse: pages read in place?
            # pre-RoPE low_rank: layer-steps whose logits the C++ kernel computed (0: rebuilt by tensors)
            "rope_kernel_steps": sum(s.get("rope_kernel_steps", 0) for s in _stats(states[name]["cache"])),
            "per_round": runs,
        }  # fmt: skip
    return out


def _stats(cache) -> list[dict]:
    return cache.stats() if hasattr(cache, "stats") else []


def measure_rounds(model, states: dict, names: list, rounds: int, steps: int) -> dict:
    """Rounds in which every contender, ``full`` first, decodes ``steps`` tokens in turn."""
    samples = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            samples[name].append(decode(model, states[name], steps))
    return samples


def measure_paired(model, states: dict, names: list, rounds: int, steps: int) -> tuple[dict, dict]:
    """Rounds in which each contender decodes right after a ``full`` measurement (see the docstring)."""
    full = states["full"]
    snap, snap_next = full["cache"].snapshot(), full["next"]
    samples, fulls = {name: [] for name in names}, {name: [] for name in names[1:]}
    for _ in range(rounds):
        for name in names[1:]:
            full["cache"].restore(snap)  # every full sample decodes from the same context
            full["next"] = snap_next
            warm_up(model, full, 1)  # untimed: the first step after a restore re-owns (copies) the buffers
            run = decode(model, full, steps)
            samples["full"].append(run)
            fulls[name].append(run)
            samples[name].append(decode(model, states[name], steps))
    return samples, fulls


def main(out: str, length: int, rounds: int = 4, steps: int = 4, *names: str) -> None:
    paired = "--paired" in names
    names = [n for n in names if n != "--paired"] or list(CONTENDERS)
    names = names if names[0] == "full" else ["full", *[n for n in names if n != "full"]]
    model, tokenizer = load_model("smollm2-135m")
    attention.install(model)
    ids = text_tokens(tokenizer, "pg_essays", length)
    load_before = os.getloadavg()
    states = {"full": prepare(model, tokenizer, ids, "full")}
    states |= {name: prepare(model, tokenizer, ids, name, states["full"]) for name in names[1:]}
    for state in states.values():
        warm_up(model, state)
    if paired:
        samples, fulls = measure_paired(model, states, names, rounds, steps)
    else:
        samples, fulls = measure_rounds(model, states, names, rounds, steps), None
    record = {
        "context": length, "rounds": rounds, "steps_per_round": steps, "dtype": str(model.dtype),
        "paired": paired, "contenders": {n: CONTENDERS[n] for n in names},
        "results": summarise(samples, states, fulls),
        "env": {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "nproc": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "shared_machine": True, **cpu_flags(),
        },
    }  # fmt: skip
    write_text_atomic(Path(out), json.dumps(record, indent=1))
    for name, r in record["results"].items():
        print(
            f"{name:>18} {r['decode_tok_s_median']:6.2f} tok/s  vs full {r['vs_full_median']:.2f} "
            f"({r['vs_full_min']:.2f}-{r['vs_full_max']:.2f})  overhead {r['policy_overhead_median']:.1%}  "
            f"per CPU second vs full {r['vs_full_cpu_median']:.2f} ({r['vs_full_cpu_min']:.2f}-"
            f"{r['vs_full_cpu_max']:.2f})"
        )


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), *(int(x) for x in a[2:4]), *a[4:])
