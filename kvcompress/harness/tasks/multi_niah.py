"""Multi-needle, multi-query retrieval: K needles in one context, compressed once, K questions.

Each needle pairs a key (a city) with a random number at its own depth; the context is compressed once
and the K questions come after it, independently from the restored compressed state or as chat turns
that keep their history (``conversation``). Reported per query (turn order), per needle depth and per key.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tqdm.auto import tqdm

from kvcompress.core.cache import build_cache
from kvcompress.harness.tasks.batched import batch_size
from kvcompress.harness.tasks.conversation import ask_all, next_turn_text, token_ids
from kvcompress.harness.tasks.grid import accuracy_metrics, compression_summary
from kvcompress.harness.tasks.multi_batched import CACHE_FIELDS, ask_batches
from kvcompress.harness.tasks.niah import _haystack_ids, sentence_cut
from kvcompress.harness.tasks.retrieval import cache_fields, eos_ids, is_correct, split_prompt


def depths_for(cfg) -> list[float]:
    """``task.depths`` (one per key), or the keys spread evenly from 0 to 100 percent."""
    k = len(cfg.needle_keys)
    depths = (
        list(cfg.depths) if cfg.get("depths") is not None else [100 * i / max(k - 1, 1) for i in range(k)]
    )
    if len(depths) != k or any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"task.depths={depths} must give one depth in [0, 100] per key ({k} keys)")
    return [float(d) for d in depths]


def insert_needles(tokenizer, hay_ids, needles: list[str], depths: list[float]) -> str:
    """The haystack with each needle at a sentence boundary near its depth (percent of ``hay_ids``)."""
    n = len(hay_ids)
    cuts = [round(n * d / 100) for d in depths]
    cuts = [c if c in (0, n) else sentence_cut(tokenizer, hay_ids, c) for c in cuts]
    pieces, last = [], 0
    for cut, needle in sorted(zip(cuts, needles, strict=True), key=lambda p: p[0]):
        pieces += [tokenizer.decode(hay_ids[last:cut]).strip(), needle.strip()]
        last = cut
    pieces.append(tokenizer.decode(hay_ids[last:]).strip())
    return " ".join(p for p in pieces if p)


def make_context(tokenizer, cfg, length: int, trial: int) -> dict:
    """Needles, values, depths and the question order of one context (reproducible from ``cfg.seed``)."""
    rng = random.Random(f"{cfg.seed}-{length}-{trial}")
    values = rng.sample(range(10 ** (cfg.digits - 1), 10**cfg.digits), len(cfg.needle_keys))
    needles = [cfg.needle.format(key=k, value=v) for k, v in zip(cfg.needle_keys, values, strict=True)]
    room = length - sum(len(tokenizer(" " + s, add_special_tokens=False).input_ids) for s in needles)
    if room < 1:
        raise ValueError(f"task.lengths: length={length} leaves no room for the haystack around the needles")
    depths = depths_for(cfg)
    context = insert_needles(tokenizer, _haystack_ids(tokenizer, cfg.text, room), needles, depths)
    order = list(range(len(cfg.needle_keys)))
    rng.shuffle(order)
    return {"context": context, "values": values, "depths": depths, "order": order}


def prepare_context(tokenizer, cfg, length: int, trial: int) -> tuple[dict, object, list[dict]]:
    """One context (``make_context``), its prompt ids (1, n) and its turns (``first``/``next`` ids of each
    question, in the order they are asked)."""
    ctx = make_context(tokenizer, cfg, length, trial)
    turns, head = [], None
    for i in ctx["order"]:
        key = cfg.needle_keys[i]
        question, prefix = cfg.question.format(key=key), cfg.answer_prefix.format(key=key)
        head, first = split_prompt(tokenizer, ctx["context"], question, cfg.chat_template, prefix)
        later = next_turn_text(tokenizer, question, prefix, cfg.chat_template)
        turns.append({"first": first, "next": token_ids(tokenizer, later)})
    return ctx, head, turns


def run_context(model, tokenizer, policy, cfg, length: int, trial: int) -> list[dict]:
    """One context through a fresh cache: one record per question, in the order they were asked."""
    ctx, head, turns = prepare_context(tokenizer, cfg, length, trial)
    cache = build_cache(policy, model)
    stop = eos_ids(model, tokenizer)
    responses = ask_all(model, tokenizer, cache, head, turns, cfg.mode, cfg.max_new_tokens, stop)
    fields = cache_fields(model, policy, cache)
    return context_records(cfg, ctx, head, (length, trial), responses, {k: fields[k] for k in CACHE_FIELDS})


def context_records(cfg, ctx: dict, head, cell: tuple[int, int], responses: list[str], cache_fields) -> list:
    """One record per question of a context, in the order they were asked (``cell``: length, trial)."""
    return [
        {"length": cell[0], "trial": cell[1], "mode": cfg.mode, "turn": t, "key": cfg.needle_keys[i],
         "depth": ctx["depths"][i], "expected": str(ctx["values"][i]), "response": r,
         "correct": is_correct(r, str(ctx["values"][i])), "context_tokens": head.shape[1], **cache_fields}
        for t, (i, r) in enumerate(zip(ctx["order"], responses, strict=True))
    ]  # fmt: skip


def run_contexts(model, tokenizer, policy, cfg, grid: list[tuple[int, int]], progress) -> list[dict]:
    """Records of every (length, trial) of ``grid``, in order; ``progress(n)`` after ``n`` contexts."""
    if batch_size(cfg) == 1:
        records = []
        for length, trial in grid:
            records += run_context(model, tokenizer, policy, cfg, length, trial)
            progress(1)
        return records
    prepared = [prepare_context(tokenizer, cfg, n, t) for n, t in grid]
    per_cell: list = [None] * len(grid)
    for i, answers, shares in ask_batches(model, tokenizer, policy, cfg, prepared, progress):
        ctx, head, _ = prepared[i]
        per_cell[i] = context_records(cfg, ctx, head, grid[i], answers, shares)
    return [record for records in per_cell for record in records]


def _accuracy_by(cases: list[dict], field: str) -> dict:
    groups: dict = {}
    for c in cases:
        groups.setdefault(c[field], []).append(float(c["correct"]))
    return {str(k): sum(v) / len(v) for k, v in sorted(groups.items())}


def run(model, tokenizer, policy, cfg, out_dir=None) -> dict:
    """Accuracy overall, per turn, per needle depth and per key over ``cfg.lengths`` x ``cfg.trials``."""
    grid = [(int(n), t) for n in cfg.lengths for t in range(cfg.trials)]
    with tqdm(total=len(grid), desc="multi_niah", disable=not cfg.get("progress", True), leave=False) as bar:
        cases = run_contexts(model, tokenizer, policy, cfg, grid, bar.update)
    per_context = [c for c in cases if c["turn"] == 0]  # compression is decided once per context
    metrics = {
        **accuracy_metrics(cases),  # with a 95% Wilson interval
        "mode": cfg.mode,
        "per_turn": _accuracy_by(cases, "turn"),
        "per_depth": _accuracy_by(cases, "depth"),
        "per_key": _accuracy_by(cases, "key"),
        **compression_summary(policy.name, per_context),
        "cases": cases,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "multi_niah_cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
        (out / "multi_niah_tables.md").write_text(tables_markdown(metrics, policy.name))
    return metrics


def tables_markdown(metrics: dict, policy_name: str) -> str:
    """Per-turn, per-depth and per-key accuracy as markdown tables."""
    parts = [f"multi_niah {policy_name} mode={metrics['mode']} accuracy={metrics['accuracy']:.2f}"]
    for title, field in (("turn", "per_turn"), ("depth %", "per_depth"), ("key", "per_key")):
        rows = "\n".join(f"| {k} | {v:.2f} |" for k, v in metrics[field].items())
        parts.append(f"| {title} | accuracy |\n|---|---|\n{rows}")
    return "\n\n".join(parts) + "\n"
