"""Host-blocking operations per layer-step of steady-state decode, for every selector x storage cell, at batch
1 and in a left-padded batch of 2, counted on the CPU with ``kvcompress.metrics.host_syncs.HostSyncs`` (what
a GPU would wait for, before and after each fix). A tiny random Llama (4 layers, head_dim 16); each cell uses
its classes' ``TEST_PARAMS`` so that it really compresses; 2 warm-up steps, then 6 counted steps.

    python experiments/gpu/host_syncs.py --out experiments/gpu/runs/host_syncs_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcompress.core.cache import build_cache, known_policies, known_storages, make_policy
from kvcompress.core.registry import make_storage
from kvcompress.metrics.host_syncs import HostSyncs
from kvcompress.runtime.padding import Padded, check_padding
from kvcompress.selectors import SchedulePolicy, StoragePreset

WARM, COUNTED, PROMPT = 2, 6, 40


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=95,
        bos_token_id=1,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def variants() -> dict[str, dict]:
    """Every storage with each of its declared ``TEST_PARAMS`` (``quant``, ``quant1``: its second)."""
    out = {}
    for name in known_storages():
        for i, params in enumerate(type(make_storage(name)).TEST_PARAMS or [{}]):
            out[f"{name}{i or ''}"] = {"name": name, **params}
    return out


def cells() -> list[tuple[str, str]]:
    plain = [n for n in known_policies() if not isinstance(make_policy(n), (StoragePreset, SchedulePolicy))]
    return [(s, v) for s in plain for v in variants()]


def policy(selector: str, variant: str):
    small = dataclasses.replace(make_policy(selector), **type(make_policy(selector)).TEST_PARAMS)
    return dataclasses.replace(small, storage=make_storage(dict(variants()[variant])))


@torch.inference_mode()
def count(model, selector: str, storage: str, batch: int) -> dict:
    """Counts per layer-step over ``COUNTED`` steady decode steps, or the refusal."""
    try:
        cache = build_cache(policy(selector, storage), model)
        if batch > 1:
            check_padding(cache, selector, "batch")
    except ValueError as err:
        return {"status": "refused", "why": str(err)[:160]}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 95, (batch, PROMPT), generator=g)
    mask = None
    if batch > 1:
        mask = torch.ones_like(ids)
        mask[1, :7] = 0  # row 1 left-padded by 7
        ids[1, :7] = 0
    stream = Padded(model, cache, mask)
    logits = stream.prompt(ids)
    for _ in range(WARM):
        logits = stream.step(logits[:, -1].argmax(-1, keepdim=True))
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    with HostSyncs() as syncs:
        for _ in range(COUNTED):
            nxt = stream.step(nxt)[:, -1].argmax(-1, keepdim=True)
    steps = COUNTED * len(cache.layers)
    return {
        "status": "ok",
        "per_layer_step": syncs.total / steps,
        "kinds": {k: v / steps for k, v in syncs.kinds.items()},
        "lines": dict(syncs.lines.most_common(4)),
    }


def table(record: dict) -> str:
    rows = ["| selector | storage | batch 1 | padded batch 2 | where (batch 1) |", "|---|---|---|---|---|"]
    for cell in record["cells"]:
        one, two = cell["batch_1"], cell["batch_2"]

        def show(r):
            return f"{r['per_layer_step']:.2f}" if r["status"] == "ok" else "refused"

        where = ", ".join(f"{k} ({v})" for k, v in one.get("lines", {}).items())
        rows.append(f"| {cell['selector']} | {cell['storage']} | {show(one)} | {show(two)} | {where} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    model = tiny()
    record = {"counted_steps": COUNTED, "cells": []}
    for selector, storage in cells():
        one, two = count(model, selector, storage, 1), count(model, selector, storage, 2)
        record["cells"].append({"selector": selector, "storage": storage, "batch_1": one, "batch_2": two})
    print(table(record))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
