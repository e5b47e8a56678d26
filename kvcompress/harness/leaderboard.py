"""The leaderboard: score against true bytes held for every method point, paired with ``full``.

Records come from ``sweep=leaderboard`` (``experiments/leaderboard/runs/point=<name>,...``): one per point
and question mode, each with its per-sample scores (``metrics.cases``: task, index, score). A point's score
is the mean over tasks of each task's mean sample score (RULER's average); its interval and its difference
from ``full`` (the same samples, the same question mode) are percentile bootstraps over samples, resampled
within each task (the paired one resamples the pairs). ``make leaderboard`` writes the figure and the table
of ``docs/results.md`` from the records; the table carries a digest of the figure's data, stored in the
PNG too, so a test can tell when either differs from the records (the block:
``kvcompress.harness.docgen.leaderboard``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcompress.harness.report import load_records

RUNS = "experiments/leaderboard/runs"
BOOTSTRAP = 2000
SEED = 0
MODES = {True: "question in prompt", False: "question after"}


@dataclass
class Point:
    """One record: a method setting in one question mode, its bytes and per-sample scores."""

    name: str
    method: str
    question_in_prompt: bool
    cache_ratio: float
    scores: dict[tuple[str, int], float] = field(default_factory=dict)  # (task, index) -> score
    run: str = ""
    docs: dict[tuple[str, int], str] = field(default_factory=dict)  # (task, index) -> document hash
    compressed: bool = True  # the record's verdict: False where the policy never acted (flagged)
    effective: float | None = None  # tokens removed over tokens seen (older records carry none: None)
    evict_at: str | None = None  # when the selector evicted (prefill / always), where its config says


def point_name(run_dir: str) -> str | None:
    """``snapkv_r75`` from a run folder named ``point=snapkv_r75,task.question_in_prompt=True``."""
    found = re.search(r"(?:^|,)point=([^,]+)", Path(run_dir).name)
    return found.group(1) if found else None


def method_of(name: str) -> str:
    """The line a point belongs to: its selector without the ratio, plus the storage it composes with
    (``snapkv_r75_int4`` -> ``snapkv+int4``, ``kvzip_r75_turboquant_int4`` -> ``kvzip+turboquant_int4``);
    a storage's own points share one line (``quant_int2`` -> ``quant``)."""
    if name == "tiered":  # its memory_bytes() is the device tier: the cold pages sit in the host tier
        return "tiered (device bytes)"
    storage = re.fullmatch(r"(quant|turboquant)_int\d", name)
    if storage:
        return storage.group(1)
    composed = re.fullmatch(r"(.+?)_r\d+_((?:turboquant_)?int\d)", name)
    if composed:
        return f"{composed.group(1)}+{composed.group(2)}"
    return re.sub(r"_r\d+", "", name)


def from_record(record: dict, name: str | None = None) -> Point | None:
    """The record as a ``Point`` (named ``name``, else by its ``point=`` folder); None for a record that is
    not a finished point."""
    name = name or point_name(record.get("run_dir", ""))
    metrics = record.get("metrics") or {}
    if record.get("status") != "ok" or name is None or "cache_ratio" not in metrics:
        return None
    cases = [c for c in metrics.get("cases") or [] if "score" in c and "index" in c]
    scores = {(c["task"], int(c["index"])): float(c["score"]) for c in cases}
    docs = {(c["task"], int(c["index"])): c["doc"] for c in cases if "doc" in c}
    mode = bool(record["config"]["task"].get("question_in_prompt", True))
    run = Path(record["run_dir"]).name
    compressed = metrics.get("compressed") is not False
    policy = record["config"].get("policy") or {}
    when = policy.get("evict_at") or (policy.get("policy") or {}).get("evict_at")  # pyramidkv: its inner's
    return Point(name, method_of(name), mode, float(metrics["cache_ratio"]), scores, run, docs, compressed,
                 metrics.get("effective_compression_ratio"), when)  # fmt: skip


def shared_samples(point: Point, full: Point) -> list[tuple[str, int]]:
    """The samples both answered; refuses a pair whose documents differ (other data under the same index)."""
    shared = sorted(set(point.scores) & set(full.scores))
    differ = [k for k in shared if k in point.docs and k in full.docs and point.docs[k] != full.docs[k]]
    if differ:
        raise ValueError(
            f"leaderboard: {point.run} and {full.run} answered different documents under the same index "
            f"({len(differ)} of {len(shared)}, first {differ[0]}): other lengths, seeds or generators "
            "cannot be paired"
        )
    return shared


def points(records: list[dict]) -> list[Point]:
    """The leaderboard points among ``records`` (``report.load_records``), those with scored samples."""
    found = [from_record(r) for r in records]
    return [p for p in found if p is not None and p.scores]


def load(root: Path, pattern: str = f"{RUNS}/*") -> list[Point]:
    return points(load_records(root, pattern))


def _task_groups(keys: list) -> list[np.ndarray]:
    """Indices of ``keys`` (task, index) grouped by task."""
    by_task = defaultdict(list)
    for i, key in enumerate(keys):
        by_task[key[0]].append(i)
    return [np.asarray(idx) for idx in by_task.values()]


def task_mean(values: np.ndarray, keys: list) -> float:
    """Mean over tasks of each task's mean of ``values`` (one per key): RULER's average."""
    return float(np.mean([values[idx].mean() for idx in _task_groups(keys)]))


def bootstrap(values: np.ndarray, keys: list) -> tuple[float, float, float]:
    """``task_mean`` of ``values`` (one per key), with a 95% percentile bootstrap that resamples
    ``BOOTSTRAP`` times within each task."""
    rng, groups = np.random.default_rng(SEED), _task_groups(keys)
    mean = task_mean(values, keys)
    draws = [values[idx[rng.integers(0, len(idx), (BOOTSTRAP, len(idx)))]].mean(axis=1) for idx in groups]
    low, high = np.percentile(np.mean(draws, axis=0), [2.5, 97.5])
    return mean, float(low), float(high)


def row(point: Point, full: Point | None) -> dict:
    """The table row of ``point``: its score with an interval, and its difference from ``full`` paired on
    the samples both answered (none when there is no ``full`` record in its mode)."""
    keys = sorted(point.scores)
    mean, low, high = bootstrap(np.array([point.scores[k] for k in keys]), keys)
    out = {"method": point.method, "point": point.name, "mode": MODES[point.question_in_prompt],
           "samples": len(keys), "bytes": point.cache_ratio, "score": mean, "score_low": low,
           "score_high": high, "compressed": point.compressed, "effective": point.effective,
           "evict_at": point.evict_at}  # fmt: skip
    shared = shared_samples(point, full) if full is not None and full is not point else []
    if shared:
        diff = np.array([point.scores[k] - full.scores[k] for k in shared])
        d, d_low, d_high = bootstrap(diff, shared)
        out |= {"paired": len(shared), "diff": d, "diff_low": d_low, "diff_high": d_high,
                "noise": d_low <= 0 <= d_high}  # fmt: skip
    return out


def rows(points: list[Point]) -> list[dict]:
    """Every point's row, best first within each question mode (prompt mode first)."""
    fulls = {p.question_in_prompt: p for p in points if p.name == "full"}
    out = [row(p, fulls.get(p.question_in_prompt)) for p in points]
    return sorted(out, key=lambda r: (r["mode"] != MODES[True], -r["score"], r["bytes"], r["point"]))


def digest(table_rows: list[dict]) -> str:
    """A short hash of what the figure plots (to 4 decimals): it changes when any plotted value does."""
    keys = ("point", "mode", "samples", "bytes", "score", "score_low", "score_high")
    data = [[r[k] if isinstance(r[k], (str, int)) else round(r[k], 4) for k in keys] for r in table_rows]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]


def cell(value: float, low: float, high: float, signed: bool = False) -> str:
    fmt = "{:+.3f}" if signed else "{:.3f}"
    return f"{fmt.format(value)} [{fmt.format(low)}, {fmt.format(high)}]"


def removed(r: dict) -> str:
    """The effective compression ratio a point reached and when it evicted; blank for older records."""
    effective = "" if r.get("effective") is None else f"{r['effective']:.3f}"
    return ", ".join(x for x in (effective, r.get("evict_at") or "") if x)


def markdown(table_rows: list[dict]) -> str:
    """The leaderboard table: score and difference from ``full`` with 95% bootstrap intervals."""
    head = ("| mode | method | point | samples | bytes held / full | score [95%] | vs full, paired [95%] "
            "| verdict | tokens removed (effective), evicts |\n" + "|---" * 9 + "|")  # fmt: skip
    lines = [head]
    for r in table_rows:
        if "diff" in r:
            versus = cell(r["diff"], r["diff_low"], r["diff_high"], signed=True) + f" (n={r['paired']})"
            verdict = "inside the noise" if r["noise"] else ("better" if r["diff"] > 0 else "worse")
        else:
            versus, verdict = "", "reference" if r["point"] == "full" else "no full record"
        if not r["compressed"] and r["point"] != "full":  # a policy that never acted: its score is full's
            verdict = f"**did not compress** ({verdict})"
        lines.append(
            f"| {r['mode']} | {r['method']} | `{r['point']}` | {r['samples']} | {r['bytes']:.3f} | "
            f"{cell(r['score'], r['score_low'], r['score_high'])} | {versus} | {verdict} | {removed(r)} |"
        )
    return "\n".join(lines)


def plot(table_rows: list[dict], path: Path, data_digest: str) -> Path:
    """Score against bytes held, one line per method, a panel per question mode, 95% bars; the PNG's
    ``Description`` holds ``data_digest``."""
    from kvcompress.harness.plots import _pyplot

    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.6), sharey=True)
    methods = sorted({r["method"] for r in table_rows if r["point"] != "full"})
    # ten hues first (tab20's dark shades), then their light shades; markers tell neighbours apart
    colors = {m: plt.get_cmap("tab20")((2 * i) % 20 + (i // 10) % 2) for i, m in enumerate(methods)}
    markers = {m: "osD^v"[i % 5] for i, m in enumerate(methods)}
    for ax, mode in zip(axes, MODES.values(), strict=True):
        mine = [r for r in table_rows if r["mode"] == mode]
        for method in methods:
            line = sorted((r for r in mine if r["method"] == method), key=lambda r: r["bytes"])
            if not line:
                continue
            xs, ys = [r["bytes"] for r in line], [r["score"] for r in line]
            yerr = [[r["score"] - r["score_low"] for r in line], [r["score_high"] - r["score"] for r in line]]
            ax.errorbar(
                xs,
                ys,
                yerr=yerr,
                marker=markers[method],
                ms=4,
                lw=1,
                capsize=2,
                color=colors[method],
                label=method,
            )
        for r in (r for r in mine if r["point"] == "full"):
            bar = [[r["score"] - r["score_low"]], [r["score_high"] - r["score"]]]
            ax.errorbar(
                [r["bytes"]], [r["score"]], yerr=bar, marker="*", ms=12, color="k", capsize=3, label="full"
            )
        ax.set(xscale="log", xlabel="bytes held / full (log)", title=mode, ylim=(-0.02, 1.02))
        ax.set_xlim(min(r["bytes"] for r in table_rows) * 0.8, 1.25)
        ax.set_xticks([t for t in (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0) if t >= ax.get_xlim()[0]])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("RULER score (mean over tasks)")
    handles = {}  # every method once, from whichever panel drew it
    for ax in axes:
        handles |= dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    fig.legend(handles.values(), handles.keys(), fontsize=8, loc="lower center", ncol=6, frameon=False)
    fig.tight_layout(rect=(0, 0.04 * (len(handles) // 6 + 1), 1, 1))  # the legend below both panels
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Description": f"leaderboard data {data_digest}"})
    plt.close(fig)
    return path


def figure_digest(path: Path) -> str | None:
    """The data digest a leaderboard PNG was written with (None: no such file or no digest)."""
    from PIL import Image

    if not path.is_file():
        return None
    text = Image.open(path).text.get("Description", "")
    return text.removeprefix("leaderboard data ") if text.startswith("leaderboard data ") else None
