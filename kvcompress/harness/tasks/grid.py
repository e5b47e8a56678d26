"""Run a retrieval task over a grid of context lengths x depths; records, accuracy table, heat map."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from tqdm.auto import tqdm

from kvcompress.harness.tasks.batched import run_cases
from kvcompress.metrics.compression import flag_uncompressed, ratios_of
from kvcompress.metrics.stats import interval_fields, wilson


def accuracy_table(cases: list[dict]) -> dict:
    """``{depth: {length: accuracy}}`` over the cases (mean when a cell holds several)."""
    cells: dict = {}
    for c in cases:
        cells.setdefault(c["depth"], {}).setdefault(c["length"], []).append(float(c["correct"]))
    return {d: {n: sum(v) / len(v) for n, v in sorted(row.items())} for d, row in sorted(cells.items())}


def table_markdown(table: dict, title: str = "") -> str:
    lengths = sorted({n for row in table.values() for n in row})
    lines = [f"| depth % \\ length | {' | '.join(map(str, lengths))} |", "|---" * (len(lengths) + 1) + "|"]
    for depth, row in table.items():
        cells = " | ".join("" if n not in row else f"{row[n]:.2f}" for n in lengths)
        lines.append(f"| {depth:g} | {cells} |")
    return (f"{title}\n\n" if title else "") + "\n".join(lines)


def save_heatmap(table: dict, path: Path, title: str) -> bool:
    """Depth x length accuracy heat map as PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    lengths = sorted({n for row in table.values() for n in row})
    depths = list(table)
    grid = [[table[d].get(n, float("nan")) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(max(4.0, 2.0 + 0.9 * len(lengths)), 1.5 + 0.45 * len(depths)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("depth %")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def compression_summary(policy_name: str, cases: list[dict]) -> dict:
    """``tokens_evicted`` over all cases, the mean ``cache_ratio`` and ``read_ratio``, ``compressed`` when
    every case compressed, and a ``warning`` naming the cases that did not (their whole prompt went through
    one prefill: the budget covers it)."""
    missed = [c for c in cases if not c["compressed"]]
    summary = {"tokens_evicted": sum(c["tokens_evicted"] for c in cases), "compressed": not missed}
    for name in ("cache_bytes", "cache_ratio", "read_ratio"):  # means over the cases that have them
        values = [c[name] for c in cases if c.get(name) is not None]
        summary[name] = sum(values) / len(values) if values else None
    summary |= mean_ratios(cases)
    summary |= storage_summary(cases)
    if missed:
        lengths = sorted({c["length"] for c in missed})
        evidence = "0 tokens evicted, every token read, bytes not below full"
        what = f"{len(missed)} of {len(cases)} cases (lengths {lengths}: {evidence})"
        hint = (
            "Their prompts were prefilled whole, so the policy's budget covers them: lower it below a prompt."
        )
        summary |= flag_uncompressed(policy_name, what, hint)
    return summary


def mean_ratios(cases: list[dict]) -> dict:
    """The cases' effective compression ratios (``retrieval.cache_fields``) averaged: overall, per layer and
    per (layer, KV head); {} when the cases carry none."""
    used = [c for c in cases if "effective_ratio_per_head" in c]
    if not used:
        return {}
    heads = [c["effective_ratio_per_head"] for c in used]  # per case, per layer, per head
    kept = [
        [sum(1.0 - r[i][h] for r in heads) for h in range(len(layer))] for i, layer in enumerate(heads[0])
    ]
    return ratios_of([len(used)] * len(kept), kept)


def storage_summary(cases: list[dict]) -> dict:
    """``storage_acted`` (an exact-window storage encoded a token in some case) with the window, and a
    ``storage_warning`` when it encoded none in any case; {} for storages without an exact window."""
    used = [c for c in cases if "storage_acted" in c]
    if not used:
        return {}
    window = max(c["storage_exact_window"] for c in used)
    out = {"storage_exact_window": window, "storage_acted": any(c["storage_acted"] for c in used)}
    if not out["storage_acted"]:
        kept = max(c["tokens_stored_mean"] for c in used)
        message = (
            f"storage encoded no token in any of the {len(used)} cases: its exact window (recent={window}) "
            f"held every token the selector kept (about {kept:.0f} per layer at most); lower the storage's "
            "recent below the tokens kept"
        )
        warnings.warn(message, stacklevel=2)
        out["storage_warning"] = message
    return out


def accuracy_metrics(cases: list[dict]) -> dict:
    """``accuracy`` with its 95% Wilson interval (``accuracy_ci_low``/``_high``),
    ``correct`` and ``cases_total``."""
    correct = sum(bool(c["correct"]) for c in cases)
    low, high = wilson(correct, len(cases))
    return {"accuracy": correct / len(cases), **interval_fields("accuracy", low, high), "correct": correct,
            "cases_total": len(cases)}  # fmt: skip


def tier_means(cases: list[dict]) -> dict:
    """Means over the cases of a tiered cache's bytes per tier, fetches per step and LRU hit rate."""
    keys = [k for k in ("device_bytes", "host_bytes", "disk_bytes", "bytes_fetched_per_step", "lru_hit_rate")
            if all(k in c for c in cases)]  # fmt: skip
    return {f"{k}_mean": sum(c[k] for c in cases) / len(cases) for k in keys}


def run_grid(model, tokenizer, policy, cfg, make_case, out_dir=None, name: str = "niah", needles: int = 1):
    """Every (length, depth, needle) of ``cfg`` through ``make_case(length, depth, needle) -> Case``,
    ``task.batch_size`` cases at a time (``batched``)."""
    grid = [(int(n), float(d), k) for n in cfg.lengths for d in cfg.depths for k in range(needles)]
    with tqdm(total=len(grid), desc=name, disable=not cfg.get("progress", True), leave=False) as bar:
        records = run_cases(model, tokenizer, policy, [make_case(*cell) for cell in grid], cfg, bar.update)
    cases = [{**record, "needle": k} for record, (_, _, k) in zip(records, grid, strict=True)]
    table = accuracy_table(cases)
    title = f"{name} {policy.name}\nquestion_in_prompt={bool(cfg.question_in_prompt)}"
    metrics = {
        **accuracy_metrics(cases),
        "question_in_prompt": bool(cfg.question_in_prompt),
        **compression_summary(policy.name, cases),
        **tier_means(cases),
        "table": {str(d): {str(n): a for n, a in row.items()} for d, row in table.items()},
        "cases": cases,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}_cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
        (out / f"{name}_table.md").write_text(table_markdown(table, title) + "\n")
        metrics["heatmap"] = str(out / f"{name}_heatmap.png") if save_heatmap(
            table, out / f"{name}_heatmap.png", title
        ) else None  # fmt: skip
    return metrics
