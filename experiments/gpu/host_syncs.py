"""Host-blocking operations per layer-step of steady-state decode, for every selector x storage cell, at batch
1 and in a left-padded batch of 2, counted on the CPU with ``kvcompress.metrics.host_syncs.HostSyncs`` (what
a GPU would wait for, before and after each fix); apart from them, those made once per model forward (the
padding check and the model's own mask). The GPU script's random Llama and cells (``smoke.model_of``,
``smoke.cells``: 4 layers, head_dim 16 here), each with its classes' ``TEST_PARAMS`` so that it really
compresses, and for a selector sized by a ratio too, once more with the ratio (``smoke.budget_paths``: the
ratio path sizes each row of a padded batch from its own real tokens); 2 warm-up steps, then 6 counted
steps. ``--embedded`` counts once on the embedded model instead (30 layers, head_dim 64; every selector on
both budget paths over the storages named by ``--storages``, dense by default).

    python experiments/gpu/host_syncs.py --out experiments/gpu/runs/host_syncs_cpu.json
    python experiments/gpu/host_syncs.py --embedded --out experiments/gpu/runs/host_syncs_embedded.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import budget_paths, cells, model_of, policy_of  # noqa: E402  (the GPU script's model and cells)

from kvcompress.core.cache import build_cache  # noqa: E402
from kvcompress.metrics.host_syncs import HostSyncs  # noqa: E402
from kvcompress.runtime.padding import Padded, check_padding  # noqa: E402

WARM, COUNTED, PROMPT = 2, 6, 40


@torch.inference_mode()
def count(model, selector: str, params: dict, batch: int, path: str = "fixed") -> dict:
    """Counts per layer-step over ``COUNTED`` steady decode steps, or the refusal."""
    try:
        cache = build_cache(policy_of(selector, params, path), model)
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
        "per_layer_step": syncs.in_layers / steps,
        "per_forward": syncs.per_forward / COUNTED,
        "kinds": {k: v / steps for k, v in syncs.kinds.items()},
        "lines": dict(syncs.lines.most_common(4)),
    }


def table(record: dict) -> str:
    rows = [
        "| selector | budget | storage | batch 1 | padded batch 2 | padded, per forward | where |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in record["cells"]:
        one, two = cell["batch_1"], cell["batch_2"]

        def show(r, key="per_layer_step"):
            return f"{r.get(key, 0):.2f}" if r["status"] == "ok" else "refused"

        lines = {**two.get("lines", {}), **one.get("lines", {})}
        where = ", ".join(f"{k} ({v})" for k, v in lines.items())
        path = cell.get("path", "fixed")
        row = [cell["selector"], path, cell["storage"], show(one), show(two), show(two, "per_forward"), where]
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--embedded", action="store_true", help="the embedded model, not the random Llama")
    parser.add_argument("--storages", default="dense", help="with --embedded: storage variants (comma list)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.embedded:
        from kvcompress import load_model

        model = load_model()[0]
        wanted = args.storages.split(",")
        chosen = [c for c in cells() if c[1] in wanted]
    else:
        model, chosen = model_of("cpu", torch.float32, head_dim=16, layers=4), cells()
    record = {"counted_steps": COUNTED, "model": model.config.model_type, "cells": []}
    for selector, storage, params in chosen:
        for path in budget_paths(selector):
            one, two = count(model, selector, params, 1, path), count(model, selector, params, 2, path)
            cell = {"selector": selector, "path": path, "storage": storage, "batch_1": one, "batch_2": two}
            record["cells"].append(cell)
            print(selector, path, storage, one.get("per_layer_step"), two.get("per_layer_step"), flush=True)
    print(table(record))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
