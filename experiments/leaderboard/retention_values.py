"""The long-value study of ``retention.py --values``: answer-token retention and exact match per setting.

Every policy at each ratio in both question modes answers the same ``harness.tasks.long_values`` needles
(5-8 digit numbers and UUID-like strings in the embedded essays); each case records what every layer and KV
head read of the answer, the needle sentence and the question (``metrics.retention``) and the exact match.
The record (one JSON file, rewritten atomically after each setting, resumable) holds every case; the tables
are made from it (``table``, ``pairs``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvcompress import make_policy
from kvcompress.harness.tasks.long_values import run_value_case
from kvcompress.harness.tasks.retrieval import eos_ids
from kvcompress.metrics.retention import summarize
from kvcompress.metrics.stats import t_interval, wilson

PAGE = 8  # offload storage's default block_size: tiered reads whole pages
SAID = ("stopped", "diverged", "ran_on", "other")  # ``response_kind``
SHARING = ("snapkv", "pyramidkv", "h2o", "tova", "kvzip", "expected_attention")  # EvictionPolicy's fields


def policy_at(name: str, ratio: float | None, prompt_tokens: int, keep: dict | None = None):
    """``name`` removing ``ratio`` of a ``prompt_tokens`` prompt: ``compression_ratio`` for eviction,
    the window for ``sliding_window`` (4 sinks), ``read_ratio = 1 - ratio`` of the cold pages for ``tiered``
    (its device LRU at least as large); ``keep``: fields every score-based selector shares (``span``, or
    ``unit`` and ``chunk_size``), for those in ``SHARING``."""
    if name == "full" or ratio is None:
        return make_policy(name)
    if name == "sliding_window":
        return make_policy(name, window=max(1, int(prompt_tokens * (1 - ratio)) - 4))
    if name == "tiered":
        pages = math.ceil((1 - ratio) * prompt_tokens / PAGE) + 2
        return make_policy(
            name, read_ratio=1 - ratio, storage={"name": "offload", "lru_pages": max(38, pages)}
        )
    policy = make_policy(name, compression_ratio=ratio)
    if not keep or name not in SHARING:
        return policy
    if name == "pyramidkv":  # the fields of the SnapKV policy its layers run
        return dataclasses.replace(policy, policy={**policy.policy, **keep})
    return dataclasses.replace(policy, **keep)


def settings(policies: list[str], ratios: list[float], modes=(True, False)) -> list[tuple]:
    """(policy, ratio, question_in_prompt) of every point: ``full`` once per mode, the others per ratio."""
    out = []
    for name in policies:
        for ratio in [None] if name == "full" else ratios:
            out += [(name, ratio, mode) for mode in modes]
    return out


def key(name: str, ratio: float | None, mode: bool) -> str:
    return f"{name}|{ratio}|{mode}"


def run(
    model, tok, cases, policies, ratios, path: Path, keep: dict | None = None, modes=(True, False)
) -> dict:
    """Every setting over ``cases``; the record at ``path`` after each one (finished settings are kept)."""
    record = json.loads(path.read_text()) if path.exists() else {"settings": {}}
    record.update(meta(cases, keep))
    stop, todo = eos_ids(model, tok), settings(policies, ratios, modes)
    for i, (name, ratio, mode) in enumerate(todo):
        if key(name, ratio, mode) in record["settings"]:
            continue
        start, samples = time.time(), []
        for case in cases:
            prompt = case.head.shape[1] + (case.tail.shape[1] if mode else 0)
            policy = policy_at(name, ratio, prompt, keep)
            samples.append(run_value_case(model, tok, policy, case, mode, stop))
        record["settings"][key(name, ratio, mode)] = {
            "policy": name, "ratio": ratio, "question_in_prompt": mode,
            "keep": keep if keep and name in SHARING else {},
            "params": {k: str(v) for k, v in vars(policy).items()}, "samples": samples,
        }  # fmt: skip
        write(path, record)
        right = sum(s["correct"] for s in samples)
        print(f"[{i + 1}/{len(todo)}] {key(name, ratio, mode)}: {right}/{len(samples)} exact, "
              f"{time.time() - start:.0f}s", flush=True)  # fmt: skip
    return record


def meta(cases, keep: dict | None) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    return {
        "command": " ".join(["python", *sys.argv]), "code_version": commit.strip(), "keep": keep or {},
        "threads": torch.get_num_threads(), "needles": len(cases),
        "cases": [{"kind": c.kind, "value": c.value, "depth": c.depth} for c in cases],
    }  # fmt: skip


def write(path: Path, record: dict) -> None:
    """Write ``record`` atomically: a temporary file next to it, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")))  # one line: about 0.8 MB for 38 settings
    os.replace(tmp, path)


def write_tables(path: Path, record: dict, before: dict[str, dict] | None = None) -> str:
    """The tables of ``record`` (``table``, ``reach_table``, ``divergence_table``; ``pairs`` against each
    record of ``before``, by file name), also written next to the record at ``path`` (``.md``): made from
    the records, never retyped."""
    parts = [table(record), reach_table(record), divergence_table(record)]
    parts += [
        f"Paired with {name} (after - before):\n\n{pairs(b, record)}" for name, b in (before or {}).items()
    ]
    sources = ", ".join([path.name, *(before or {})])
    path.with_suffix(".md").write_text(
        f"<!-- made from {sources} by retention.py -->\n" + "\n\n".join(parts) + "\n"
    )
    return "\n\n".join(parts)


def sample_numbers(s: dict, field: str = "answer_first") -> dict:
    """``summarize`` of one case's hits in ``field`` over the answer's tokens."""
    return summarize(torch.tensor(s[field]), s["answer_tokens"])


def loss_kind(s: dict) -> str:
    """A wrong case: ``whole`` (every layer and head read the whole answer), ``none`` (none read any of
    it), else ``partial``."""
    n = sample_numbers(s)
    return "whole" if n["whole_everywhere"] == 1 else ("none" if n["pairs_none"] == 1 else "partial")


def label(setting: dict) -> str:
    """The policy and the shared keeping fields of a setting: ``snapkv span=8``."""
    return " ".join([setting["policy"], *(f"{k}={v}" for k, v in (setting.get("keep") or {}).items())])


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def table(record: dict) -> str:
    """The markdown table of a record: per setting, exact match (95% Wilson interval), the answer's
    retention at its first decode step (share of its tokens read, the whole-answer rate over (layer, KV
    head) pairs, the cases whole in every pair), the wrong cases by ``loss_kind``, the needle sentence's
    share and the cache's bytes against ``full``'s."""
    rows = [
        "| policy | ratio | question | exact match | answer share | whole-answer rate (pairs) "
        "| whole everywhere | wrong, read: whole / partial / none | wrong, said: stopped / diverged / ran on "
        "/ other | needle share | cache ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in record["settings"].values():
        cases, n = s["samples"], len(s["samples"])
        nums = [sample_numbers(c) for c in cases]
        right = sum(c["correct"] for c in cases)
        lo, hi = wilson(right, n)
        wrong = [loss_kind(c) for c in cases if not c["correct"]]
        said = [response_kind(c["value"], c["response"]) for c in cases if not c["correct"]]
        needle = mean(mean(sum(c["needle_first"], [])) / c["needle_tokens"] for c in cases)
        rows.append(
            f"| {label(s)} | {s['ratio'] or ''} | "
            f"{'in prompt' if s['question_in_prompt'] else 'after'} | {right}/{n} [{lo:.2f}, {hi:.2f}] | "
            f"{mean(x['share'] for x in nums):.3f} | {mean(x['whole_rate'] for x in nums):.3f} | "
            f"{sum(x['whole_everywhere'] for x in nums):.0f}/{n} | "
            f"{wrong.count('whole')} / {wrong.count('partial')} / {wrong.count('none')} | "
            f"{' / '.join(str(said.count(k)) for k in SAID)} | {needle:.3f} | "
            f"{mean(c['cache_ratio'] for c in cases):.3f} |"
        )
    return "\n".join(rows)


def reach_table(record: dict, policy: str = "tiered") -> str:
    """Which of the answer's tokens a page-reading ``policy``'s fetches reached: at the first decode step,
    at every step of the answer and at any step (the pages of the step that produced each token included)."""
    rows = [
        "| policy | ratio | question | exact match | whole-answer rate: first step | every step | any step "
        "| answer share: any step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in record["settings"].values():
        if s["policy"] != policy:
            continue
        cases = s["samples"]
        rate = {
            f: mean(sample_numbers(c, f"answer_{f}")["whole_rate"] for c in cases)
            for f in ("first", "all", "any")
        }
        share_any = mean(sample_numbers(c, "answer_any")["share"] for c in cases)
        rows.append(
            f"| {policy} | {s['ratio']} | {'in prompt' if s['question_in_prompt'] else 'after'} | "
            f"{sum(c['correct'] for c in cases)}/{len(cases)} | {rate['first']:.3f} | "
            f"{rate['all']:.3f} | {rate['any']:.3f} | {share_any:.3f} |"
        )
    return "\n".join(rows)


def pairs(before: dict, after: dict) -> str:
    """Paired 95% t-intervals (``metrics.stats``) of after - before over the same needles, per setting in
    both records: exact match and the whole-answer rate over (layer, KV head) pairs."""
    rows = [
        "| policy | ratio | question | exact match before → after | Δ exact match [95%] "
        "| whole-answer rate before → after | Δ whole-answer rate [95%] |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, a in after["settings"].items():
        b = before["settings"].get(k)
        if b is None:
            continue
        if [c["value"] for c in a["samples"]] != [c["value"] for c in b["samples"]]:
            raise ValueError(f"pairs: setting {k} answered other needles before and after")
        cells = []
        for get in (lambda c: float(c["correct"]), lambda c: sample_numbers(c)["whole_rate"]):
            x, y = [get(c) for c in b["samples"]], [get(c) for c in a["samples"]]
            ci = t_interval([q - p for p, q in zip(x, y, strict=True)])
            span = "" if ci["low"] is None else f" [{ci['low']:+.3f}, {ci['high']:+.3f}]"
            cells += [f"{mean(x):.3f} → {mean(y):.3f}", f"{ci['mean']:+.3f}{span}"]
        mode = "in prompt" if a["question_in_prompt"] else "after"
        rows.append(f"| {label(a)} | {a['ratio']} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def response_kind(value: str, response: str) -> str:
    """How a wrong response's first word relates to ``value``: ``stopped`` (a strict prefix: the copy
    ended early), ``diverged`` (the first characters right, then a wrong one), ``ran_on`` (the whole value
    and more) or ``other`` (wrong from the first character)."""
    words = response.split()
    word = words[0].strip(".,;:!?\"'()") if words else ""
    shared = next(
        (i for i, (a, b) in enumerate(zip(word, value, strict=False)) if a != b), min(len(word), len(value))
    )
    if shared == 0:
        return "other"
    if word.startswith(value):
        return "ran_on"
    return "stopped" if value.startswith(word) else "diverged"


def divergence_table(record: dict) -> str:
    """Where a copied number went wrong (digits: token j is character j): the share of (layer, KV head)
    pairs that read the answer's tokens before the first wrong or missing digit, and the one at it, in the
    wrong cases that began with the value (``stopped``, ``diverged``); beside it the right cases' weakest
    token. A drop at the divergence is a value kept in part: its head read, its tail lost."""
    rows = [
        "| policy | ratio | question | wrong cases that began with the value | share read: tokens before "
        "| token at the divergence | right cases: weakest token |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in record["settings"].values():
        before, at, weakest = [], [], []
        for c in s["samples"]:
            if c["kind"] == "uuid":
                continue
            read = c["answer_tokens_read"]
            if c["correct"]:
                weakest.append(min(read))
            elif response_kind(c["value"], c["response"]) in ("stopped", "diverged"):
                word = c["response"].split()[0]
                j = next(i for i, (a, b) in enumerate(zip(word + "\0", c["value"], strict=False)) if a != b)
                before.append(mean(read[:j]))
                at.append(read[j])
        if not before:
            continue
        mode = "in prompt" if s["question_in_prompt"] else "after"
        right = f"{mean(weakest):.3f} ({len(weakest)})" if weakest else ""
        rows.append(
            f"| {label(s)} | {s['ratio'] or ''} | {mode} | {len(before)} | {mean(before):.3f} | "
            f"{mean(at):.3f} | {right} |"
        )
    return "\n".join(rows)
