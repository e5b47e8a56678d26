"""kvcompress's side of the differential test: the same prompts and methods as ``kvpress_side.py``, through
``build_cache``. The kept positions per (layer, KV head) are what the first decode step's attention can read
(``metrics.retention.ReadSets``), less that step's own token."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kvcompress import build_cache, make_policy
from kvcompress.metrics.retention import ReadSets
from kvcompress.runtime.context_pass import prefill

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from peer_methods import METHODS  # noqa: E402


def our_policy(name: str, ratio: float, n_tokens: int):
    """The kvcompress policy that ``METHODS[name]`` maps kvpress's press to, at ``ratio`` on ``n_tokens``."""
    spec = dict(METHODS[name]["ours"])
    if spec.pop("window_from_keep", False):  # a fixed window sized as kvpress sizes StreamingLLM's
        spec["window"] = max(1, int(n_tokens * (1 - ratio))) - spec["sink_tokens"]
    else:
        spec["compression_ratio"] = ratio
    return make_policy(spec) if "_target_" in spec else make_policy(spec.pop("name"), **spec)


def held_positions(snapshot: list[torch.Tensor], n_tokens: int) -> list[list[list[int]]]:
    """Per layer and KV head, the sorted prompt positions (< ``n_tokens``) a decode step read."""
    out = []
    for pos in snapshot:  # (1, 1 or H_kv, T), -1 where not readable
        rows = pos[0].long().tolist()
        out.append([sorted({p for p in row if 0 <= p < n_tokens}) for row in rows])
    return out


def read_kept(model, reads: ReadSets, n_tokens: int) -> list[list[list[int]]]:
    """What the first decode step read (exactly what the prefill kept, plus itself), per layer and KV head."""
    heads = model.config.num_key_value_heads
    return [row * heads if len(row) == 1 else row for row in held_positions(reads.snapshot(), n_tokens)]


def flat_kept(cache, full) -> list[list[list[int]]]:
    """Kept positions of head-adaptive layers (Ada-KV: pairs held flat, ``head_of`` naming each one's KV
    head), found by matching each stored key to the identical key of a full prefill ``full`` (layers of
    (1, H_kv, T, D))."""
    out = []
    for layer, ref in zip(cache.layers, full, strict=True):
        keys, head_of = layer.store.read()[0][0, 0], layer.head_of[0, 0].long()  # (N, D), (N,)
        rows = []
        for h in range(ref.shape[1]):
            mine = keys[head_of == h].double()
            rows.append(sorted(set(torch.cdist(mine, ref[0, h].double()).argmin(-1).tolist())))
        out.append(rows)
    return out


@torch.inference_mode()
def run_one(model, tokenizer, policy, ids: list[int], max_new: int, stop: set[int]) -> dict:
    """Prefill ``ids`` through ``policy`` (and its context pass), read the kept sets, greedy-decode."""
    if getattr(policy, "adaptive", False):  # flat per-head pairs: matched against a full prefill's keys
        full = build_cache("full", model)
        model(torch.tensor([ids]), cache=full, use_cache=True)
        full_keys = [layer.keys for layer in full.layers]
    cache = build_cache(policy, model)
    reads = None if getattr(policy, "adaptive", False) else ReadSets(cache)
    logits = prefill(model, cache, torch.tensor([ids]), tokenizer).logits
    if reads is None:
        kept = flat_kept(cache, full_keys)
    kept = None if reads is not None else kept
    answer = []
    for _ in range(max_new):
        nxt = int(logits[0, -1].argmax())
        if nxt in stop:
            break
        answer.append(nxt)
        logits = model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits
        kept = kept or read_kept(model, reads, len(ids))
    if kept is None:  # stopped at once: one decode step to read what the prefill kept
        model(torch.tensor([[int(logits[0, -1].argmax())]]), cache=cache, use_cache=True)
        kept = read_kept(model, reads, len(ids))
    return {"kept": kept, "answer": answer}


def run_ours(model, tokenizer, methods, prompts, ratio: float, max_new: int) -> dict:
    """``{method: [per prompt {"kept", "answer"}]}`` for kvcompress."""
    eos = model.generation_config.eos_token_id
    stop = set(eos) if isinstance(eos, list) else {eos}
    out = {}
    for name in methods:
        out[name] = [
            run_one(model, tokenizer, our_policy(name, ratio, len(ids)), ids, max_new, stop)
            for ids in prompts
        ]
    return out
