"""Hydra task ``task=lm_eval``: lm-eval tasks scored through the policy cache (``KVCompressLM``)."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter

from omegaconf import OmegaConf

from kvcompress.metrics.compression import full_cache_bytes

CASE_FIELDS = ("depth", "length", "id", "index")


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _metric_keys(values: dict) -> list[tuple[str, str, float]]:
    """(metric, filter, value) of lm-eval's ``"metric,filter"`` keys, stderr and non-numbers left out."""
    found = []
    for key, value in values.items():
        metric, _, filt = key.partition(",")
        if filt and not metric.endswith("_stderr") and isinstance(value, (int, float)):
            found.append((metric, filt, float(value)))
    return found


def flatten_results(results: dict) -> dict:
    """``{"task/metric": value}`` from lm-eval's results; a filter is named only if a metric has several."""
    metrics = {}
    for task, values in results.get("results", {}).items():
        found = _metric_keys(values)
        counts = Counter(metric for metric, _, _ in found)
        for metric, filt, value in found:
            metrics[f"{task}/{metric}" if counts[metric] == 1 else f"{task}/{metric}_{filt}"] = value
    return metrics


def mean_score(results: dict) -> float | None:
    """The mean of every task's ``score`` when every task that ran has one (a tag such as ``kvc_ruler``
    counts its tasks), else None. A group's own row (its aggregate, listed in ``group_subtasks``) is left
    out: its subtasks count once each."""
    groups = {name for name, subtasks in (results.get("group_subtasks") or {}).items() if subtasks}
    found = [v.get("score,none") for k, v in (results.get("results") or {}).items() if k not in groups]
    if not found or not all(isinstance(x, (int, float)) for x in found):
        return None
    return sum(found) / len(found)


def doc_hash(doc: dict) -> str:
    """A short fingerprint of a document: two records pair a sample only when they answered the same one."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cases(results: dict) -> list[dict]:
    """Per-document rows (task, depth, length, id or index, metrics) of the tasks whose documents carry a
    depth (needles) or an index (RULER): what paired comparisons match across records."""
    rows = []
    for task, items in (results.get("samples") or {}).items():
        names = {metric for metric, _, _ in _metric_keys(results["results"].get(task, {}))}
        for item in items:
            doc = item.get("doc", {})
            if "depth" in doc or "index" in doc:
                row = {"task": task, **{k: doc[k] for k in CASE_FIELDS if k in doc}, "doc": doc_hash(doc)}
                scores = {m: float(item[m]) for m in sorted(names) if isinstance(item.get(m), (int, float))}
                rows.append(row | scores)
    return rows


def _metadata(tokenizer, cfg) -> dict:
    """What the tasks' data builders read: the RULER lengths and the tokenizer that sizes them."""
    lengths = _plain(cfg.get("max_seq_lengths"))
    meta = {"tokenizer": getattr(tokenizer, "name_or_path", None)}
    return meta | ({"max_seq_lengths": list(lengths)} if lengths else {})


def run(model, tokenizer, policy, cfg) -> dict:
    """Run ``cfg.tasks`` with lm-eval through ``policy``; metrics, cache bytes vs ``full``, whether the policy
    compressed (``tokens_evicted``, ``compressed``, a ``warning`` when it never did), per-case rows."""
    import lm_eval

    from kvcompress.eval.adapter import KVCompressLM
    from kvcompress.eval.taskdata import task_manager

    tasks = list(_plain(cfg.tasks))
    lm = KVCompressLM(
        pretrained=model,
        tokenizer=tokenizer,
        policy=policy,
        chunk_size=cfg.chunk_size,
        max_length=cfg.get("max_length"),
        batch_size=cfg.get("batch_size", 1),
        question_in_prompt=cfg.get("question_in_prompt", True),
        question_start=cfg.get("question_start"),
    )
    start, cpu = time.perf_counter(), time.process_time()
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=task_manager(tasks, cfg.get("include_path"), _metadata(tokenizer, cfg)),
        limit=cfg.get("limit"),
        num_fewshot=cfg.get("num_fewshot"),
        gen_kwargs=_plain(cfg.get("gen_kwargs")),
        apply_chat_template=cfg.get("apply_chat_template", False),
        log_samples=True,
        bootstrap_iters=cfg.get("bootstrap_iters", 0),
    )
    seconds = time.perf_counter() - start  # lm-eval's whole evaluation: building requests and scoring
    cpu = time.process_time() - cpu  # this process's CPU time: what a shared machine's load does not inflate
    metrics = flatten_results(out)
    score = mean_score(out)
    if score is not None:  # RULER-style tasks: one number to rank or optimise
        metrics["score"] = score
    stats = lm.kvc_stats
    metrics.update({k: stats[k] for k in ("chunk_size", "requests", "forward_calls", "tokens")})
    metrics |= {"batch_size": lm.batch_size, "eval_s": seconds, "requests_per_s": stats["requests"] / seconds,
                "eval_cpu_s": cpu, "requests_per_cpu_s": stats["requests"] / cpu}  # fmt: skip
    if stats.get("cache_bytes") is not None:
        metrics["cache_bytes"] = stats["cache_bytes"]
        metrics["full_cache_bytes"] = full_cache_bytes(model, stats["tokens"], stats["batch"])
        metrics["cache_ratio"] = metrics["cache_bytes"] / metrics["full_cache_bytes"]
    info = out.get("config", {}).get("kvcompress") or lm.get_model_info()["kvcompress"]
    kept = ("effective_compression_ratio", "effective_ratio_per_layer", "effective_ratio_per_head")
    metrics.update(
        {k: info[k] for k in ("tokens_evicted", "read_ratio", "compressed", "warning", *kept) if k in info}
    )
    metrics["question_in_prompt"] = lm.question_in_prompt
    metrics["cases"] = cases(out)
    return metrics
