"""Plots from result records: perplexity (or attention recall) vs cache bytes (Pareto front), NIAH heat-maps,
decode speed, KL over steps."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from kvcompress.harness.report import flatten, interval
from kvcompress.metrics.stats import wilson

SCORE_KEYS = ("score", "correct", "exact_match", "accuracy", "acc")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label(row: dict) -> str:
    return f"{row['policy']} {row['params']}".strip()


def perplexity_key(rows: list[dict]) -> str | None:
    """``perplexity`` (decode mode) if recorded, else an lm-eval word/byte perplexity column."""
    keys = {k for r in rows for k in r}
    if "perplexity" in keys:
        return "perplexity"
    found = sorted(k for k in keys if k.endswith(("/word_perplexity", "/byte_perplexity")))
    return found[0] if found else None


def pareto_front(points: list[tuple[float, float]], higher: bool = False) -> list[tuple[float, float]]:
    """Points (bytes, perplexity) that no other point beats on both (fewer bytes and lower perplexity);
    ``higher``: a larger y is better (attention recall)."""
    front, best = [], float("inf")
    for x, y in sorted(points):
        if (-y if higher else y) < best:
            front.append((x, y))
            best = -y if higher else y
    return front


def varying_params(rows: list[dict]) -> list[str]:
    """Each row's ``params`` ("a=1 b=2") reduced to the fields that differ between the rows (the swept
    ones), so plot labels stay short; all of them when there is a single row."""
    fields = [str(r.get("params") or "").split() for r in rows]
    shared = set.intersection(*(set(f) for f in fields)) if len(fields) > 1 else set()
    return [" ".join(f for f in fs if f not in shared) for fs in fields]


def plot_pareto(rows: list[dict], path: Path, key: str | None = None) -> Path | None:
    """``key`` (default: perplexity) against cache bytes, per policy, with the Pareto front."""
    higher = key == "recall_mean"
    key = key or perplexity_key(rows)
    rows = [r for r in rows if key and r.get(key) is not None and r.get("cache_bytes")]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_policy = defaultdict(list)
    for r in rows:
        by_policy[r["policy"]].append(r)
    for policy, group in sorted(by_policy.items()):
        xs, ys = [r["cache_bytes"] / 2**20 for r in group], [r[key] for r in group]
        points = ax.scatter(xs, ys, label=policy, s=36)
        _error_bars(ax, xs, ys, [interval(r, key) for r in group], points.get_facecolor()[0])
        for r, text in zip(group, varying_params(group), strict=True):
            ax.annotate(text, (r["cache_bytes"] / 2**20, r[key]), fontsize=7, alpha=0.8)
    front = pareto_front([(r["cache_bytes"] / 2**20, r[key]) for r in rows], higher)
    ax.plot(*zip(*front, strict=True), "k--", lw=1, label="Pareto front")
    title = f"{key} vs cache bytes" + (" (bars: 95% interval)" if any(interval(r, key) for r in rows) else "")
    ax.set(xscale="log", xlabel="cache MiB (log)", ylabel=key, title=title)
    _log_ticks(ax, sorted({r["cache_bytes"] / 2**20 for r in rows}))
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _error_bars(ax, xs, ys, spans, color) -> None:
    """Vertical bars for the points that carry an interval (95% or interquartile); none for the rest."""
    for x, y, span in zip(xs, ys, spans, strict=True):
        if span is not None:
            ax.errorbar([x], [y], yerr=[[y - span[0]], [span[1] - y]], fmt="none", ecolor=color, capsize=3)


def _log_ticks(ax, values: list[float]) -> None:
    """Readable ticks on a log axis: at the data when there are few values, plain numbers otherwise."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if len(values) <= 8:
        ax.set_xticks(values)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _niah_grids(records: list[dict]) -> dict[str, dict[tuple[float, float], list[float]]]:
    """Per label: {(depth, length): [scores]} from the records' per-case rows."""
    grids = defaultdict(lambda: defaultdict(list))
    for record in records:
        cases = record.get("metrics", {}).get("cases") or []
        for case in cases:
            score = next((case[k] for k in SCORE_KEYS if k in case), None)
            if score is None or "depth" not in case or "length" not in case:
                continue
            name = label(flatten(record)) + (f" [{case['task']}]" if "task" in case else "")
            grids[name][(float(case["depth"]), float(case["length"]))].append(float(score))
    return grids


def plot_niah(records: list[dict], path: Path) -> Path | None:
    grids = _niah_grids(records)
    if not grids:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(grids), figsize=(3.6 * len(grids), 3.4), squeeze=False)
    for ax, (name, cells) in zip(axes[0], grids.items(), strict=True):  # records are in sweep order
        depths = sorted({d for d, _ in cells})
        lengths = sorted({n for _, n in cells})
        acc = [[_mean(cells.get((d, n))) for n in lengths] for d in depths]  # None: no case at that cell
        grid = [[float("nan") if v is None else v for v in row] for row in acc]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(acc):
            for j, v in enumerate(row):
                ax.text(j, i, "" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [f"{n:g}" for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set(xlabel="context length", ylabel="needle depth", title=name + _wilson_note(cells))
        ax.title.set_fontsize(7)
    return _save(fig, plt, path)


def _wilson_note(cells: dict) -> str:
    """``"\n7/10 correct, 95% [0.40, 0.89]"`` when every score is 0 or 1, else nothing."""
    scores = [v for values in cells.values() for v in values]
    if not scores or any(v not in (0.0, 1.0) for v in scores):
        return ""
    k, n = int(sum(scores)), len(scores)
    return "\n{}/{} correct, 95% [{:.2f}, {:.2f}]".format(k, n, *wilson(k, n))


def _mean(values):
    return None if not values else sum(values) / len(values)


def _context(record: dict) -> int | None:
    metrics, task = record.get("metrics", {}), record.get("config", {}).get("task", {})
    return metrics.get("prompt_tokens") or task.get("prefill_tokens") or task.get("max_tokens")


def plot_speed(records: list[dict], path: Path) -> Path | None:
    lines = defaultdict(list)
    for record in records:
        tok_s, context = record.get("metrics", {}).get("decode_tok_s"), _context(record)
        if tok_s and context:
            row = flatten(record)
            lines[label(row)].append((context, tok_s, interval(row, "decode_tok_s")))
    if not lines:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(lines.items()):
        points = sorted(points, key=lambda p: p[0])
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=name)
        _error_bars(
            ax, [p[0] for p in points], [p[1] for p in points], [p[2] for p in points], line.get_color()
        )
    title = "decode speed vs context length (median, bars: interquartile range)"
    ax.set(xlabel="context tokens (prompt)", ylabel="decode tokens/s", title=title)
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def plot_kl_curves(records: list[dict], path: Path) -> Path | None:
    """KL(full || policy) over the scored tokens, one curve per run (``task=fidelity``'s ``kl_curve``),
    on a log axis floored at 1e-5 (exact agreement sits on the floor)."""
    ok = [r for r in records if r.get("metrics", {}).get("kl_curve")]
    if not ok:
        return None
    rows = [flatten(r) for r in ok]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r, row, extra in zip(ok, rows, varying_params(rows), strict=True):
        x, y = zip(*r["metrics"]["kl_curve"], strict=True)
        ax.plot(x, [max(v, 1e-5) for v in y], label=f"{row['policy']} {extra}".strip())
    ax.set(xlabel="token position", ylabel="KL(full || policy), nats", yscale="log", ylim=(1e-5, None))
    ax.set_title("KL over steps (mean per bin of tokens)")
    ax.legend(fontsize=6)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def make_plots(records: list[dict], out_dir: Path) -> list[Path]:
    """Every plot the records have data for, written as PNG into ``out_dir``."""
    rows = [flatten(r) for r in records if r.get("status") == "ok"]
    ok = [r for r in records if r.get("status") == "ok"]
    made = [
        plot_pareto(rows, Path(out_dir) / "pareto.png"),
        plot_niah(ok, Path(out_dir) / "niah_heatmap.png"),
        plot_speed(ok, Path(out_dir) / "decode_speed.png"),
        plot_pareto(rows, Path(out_dir) / "pareto_recall.png", key="recall_mean"),
        plot_kl_curves(ok, Path(out_dir) / "kl_steps.png"),
    ]
    return [p for p in made if p is not None]
