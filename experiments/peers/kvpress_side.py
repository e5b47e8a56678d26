"""kvpress's side of the differential test, run by the ``.venv-peers`` interpreter (kvpress, transformers,
torch). For each method of ``peer_methods.METHODS`` asked for and each prompt (token ids), prefill it under
the press, recover the positions kept per (layer, KV head), then greedy-decode. Kept positions are exact:
a forward hook registered before the press's own keeps each layer's uncompressed keys, and every compressed
key is matched to the identical uncompressed one (a press gathers, so the match is exact); pairs a press only
masks (``masked_key_indices``: AdaKV, KVzip) are removed from the kept sets.

    .venv-peers/bin/python experiments/peers/kvpress_side.py JOB.json OUT.json

JOB: ``{"model": dir, "prompts": [[ids]], "methods": [...], "compression_ratio": r, "max_new_tokens": n}``.
OUT: ``{"versions": {...}, "methods": {name: [{"kept": [[[pos]]], "answer": [ids], "match_error": e}]}}``.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import kvpress
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_methods import METHODS  # noqa: E402


def make_press(spec: dict, ratio: float):
    """A kvpress press from ``{"name": class, kwargs..., "press": inner}``; the ratio goes to the scorer."""
    kwargs = {k: v for k, v in spec.items() if k not in ("name", "press")}
    if "press" in spec:
        return getattr(kvpress, spec["name"])(press=make_press(spec["press"], ratio), **kwargs)
    return getattr(kvpress, spec["name"])(compression_ratio=ratio, **kwargs)


def kept_positions(full: torch.Tensor, kept: torch.Tensor) -> tuple[list[list[int]], float]:
    """Per KV head, the positions of ``full`` (1, H, T, D) that ``kept`` (1, H, k, D) holds, and the largest
    distance of a match (0 when every kept key is an exact copy)."""
    dist = torch.cdist(kept[0].double(), full[0].double())  # (H, k, T)
    best = dist.min(dim=-1)
    heads = [sorted(set(row.tolist())) for row in best.indices]
    return heads, float(best.values.max()) if best.values.numel() else 0.0


def snapshot_hooks(model, store: dict) -> list:
    """Hooks that keep each layer's uncompressed keys of the prefill (they run before the press's, registered
    later; a context pass's later forwards, KVzip's, are not kept)."""

    def hook(module, args, kwargs, output):
        store.setdefault(module.layer_idx, kwargs["past_key_values"].layers[module.layer_idx].keys)

    return [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]


def masked_out(model, kept: list[list[list[int]]]) -> None:
    """Remove the pairs a press masks instead of dropping (``masked_key_indices``) from ``kept``."""
    for i, layer in enumerate(model.model.layers):
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is None:
            continue
        _, heads, seqs = masked
        drop = [set() for _ in kept[i]]
        for h, s in zip(heads.tolist(), seqs.tolist(), strict=True):
            drop[h].add(s)
        kept[i] = [[p for p in row if p not in gone] for row, gone in zip(kept[i], drop, strict=True)]


def greedy(model, cache, logits, n_tokens: int, max_new: int, stop: set[int]) -> list[int]:
    """Greedy tokens from the prefill's ``logits`` until a ``stop`` id; positions continue from ``n_tokens``
    (the compressed cache's length is not the sequence's)."""
    answer = []
    for step in range(max_new):
        nxt = int(logits[0, -1].argmax())
        if nxt in stop:
            break
        answer.append(nxt)
        pos = torch.tensor([[n_tokens + step]])
        logits = model(torch.tensor([[nxt]]), past_key_values=cache, position_ids=pos).logits
    return answer


@torch.inference_mode()
def run_one(model, press, ids: list[int], max_new: int, stop: set[int]) -> dict:
    """Prefill ``ids`` under ``press``, read the kept sets, greedy-decode; the answer is a message when
    kvpress cannot decode."""
    inputs = torch.tensor([ids])
    cache, full = DynamicCache(), {}
    hooks = snapshot_hooks(model, full)
    try:
        with press(model):
            logits = model(inputs, past_key_values=cache).logits
    finally:
        for h in hooks:
            h.remove()
    found = [kept_positions(full[i], layer.keys) for i, layer in enumerate(cache.layers)]
    kept = [heads for heads, _ in found]
    masked_out(model, kept)
    try:
        answer = greedy(model, cache, logits, len(ids), max_new, stop)
    except (
        ValueError
    ) as err:  # masked pairs need a fake key no query reaches: tiny random models may have none
        answer = f"kvpress could not decode: {err}"
    return {"kept": kept, "answer": answer, "match_error": max(e for _, e in found)}


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    stop = set(eos) if isinstance(eos, list) else {eos}
    versions = {"kvpress": version("kvpress"), "transformers": transformers.__version__}
    versions["torch"] = torch.__version__
    out = {"versions": versions, "methods": {}}
    for name in job["methods"]:
        spec = METHODS[name]["press"]
        out["methods"][name] = [
            run_one(model, make_press(spec, job["compression_ratio"]), ids, job["max_new_tokens"], stop)
            for ids in job["prompts"]
        ]
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])
