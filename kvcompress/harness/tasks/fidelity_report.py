"""The fidelity trace as a one-line summary, ``fidelity.json`` and plots (recall heat maps, KL over steps)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcompress.resources.files import write_text_atomic

CURVE_POINTS = 64  # the KL curve kept in results.json: mean KL over this many bins of tokens


def summarize(trace: dict) -> dict:
    """Scalars for ``results.json``.

    ``recall_mean``: over measured steps, layers and KV heads. ``recall_min``: the worst measured step (its
    mean over layers and heads). ``recall_min_layer``: the worst layer (mean over steps and heads), with
    its index. ``kl_curve``: [first token, mean KL] over ``CURVE_POINTS`` bins of the scored tokens.
    """
    kl = torch.tensor(trace["kl"], dtype=torch.float64)
    out = {
        "tokens_scored": len(trace["kl"]),
        "steps_measured": len(trace["recall"]),
        "kl_mean": float(kl.mean()) if len(kl) else None,
        "kl_max": float(kl.max()) if len(kl) else None,
        "top1_agreement": sum(trace["top1"]) / max(len(trace["top1"]), 1),
    }
    if trace["recall"]:
        recall = torch.tensor(trace["recall"], dtype=torch.float64)  # (S, L, H_kv)
        by_layer = recall.mean((0, 2))
        out |= {
            "recall_mean": float(recall.mean()),
            "recall_min": float(recall.mean((1, 2)).min()),
            "recall_min_layer": float(by_layer.min()),
            "recall_min_layer_idx": int(by_layer.argmin()),
        }
        for k in ("output_error", "key_error", "value_error"):
            out[f"{k}_mean"] = float(torch.tensor(trace[k], dtype=torch.float64).mean())
    out["kl_curve"] = _binned(trace["token"], trace["kl"])
    return out


def _binned(tokens: list[int], values: list[float]) -> list[list[float]]:
    n = len(values)
    if n == 0:
        return []
    size = max(1, -(-n // CURVE_POINTS))
    return [[tokens[i], sum(values[i : i + size]) / len(values[i : i + size])] for i in range(0, n, size)]


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def write_outputs(trace: dict, summary: dict, out_dir, title: str = "") -> list[Path]:
    """``fidelity.json`` (the whole trace, 4 significant digits, compact) and the PNG plots in ``out_dir``."""
    out_dir = Path(out_dir)
    record = {"summary": summary, **{k: _rounded(v) for k, v in trace.items()}}
    write_text_atomic(out_dir / "fidelity.json", json.dumps(record, separators=(",", ":"), default=str))
    files = [out_dir / "fidelity.json"]
    if trace["recall"]:
        files += plot_recall(trace, out_dir, title)
    files.append(plot_kl(trace, out_dir / "kl_steps.png", title))
    return files


def _pyplot():
    from kvcompress.harness.plots import _pyplot as pyplot

    return pyplot()


def plot_recall(trace: dict, out_dir: Path, title: str) -> list[Path]:
    """Heat maps of recall: layer x step (mean over heads) and layer x head (mean over steps)."""
    plt = _pyplot()
    recall = torch.tensor(trace["recall"])  # (S, L, H_kv)
    steps = trace["layer_step"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [4, 1]})
    im = a.imshow(recall.mean(2).T.numpy(), aspect="auto", vmin=0, vmax=1, cmap="viridis", origin="lower",
                  extent=(steps[0], steps[-1] + 1, -0.5, recall.shape[1] - 0.5))  # fmt: skip
    a.set(xlabel="token position (measured step)", ylabel="layer", title=f"attention recall: {title}")
    a.title.set_fontsize(8)
    b.imshow(recall.mean(0).numpy(), aspect="auto", vmin=0, vmax=1, cmap="viridis", origin="lower")
    for (i, j), v in _cells(recall.mean(0)):
        b.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5, color="w")
    b.set(xlabel="KV head", ylabel="layer", title="mean over steps")
    b.title.set_fontsize(8)
    fig.colorbar(im, ax=b, fraction=0.08)
    fig.tight_layout()
    path = out_dir / "recall_heatmap.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _cells(m: torch.Tensor):
    return (((i, j), float(m[i, j])) for i in range(m.shape[0]) for j in range(m.shape[1]))


def plot_kl(trace: dict, path: Path, title: str) -> Path:
    """KL(full || policy) per scored token, with its running mean over 32 tokens."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    kl = torch.tensor(trace["kl"])
    ax.plot(trace["token"], kl.numpy(), lw=0.5, alpha=0.4, label="per token")
    if len(kl) >= 32:
        smooth = kl.unfold(0, 32, 1).mean(-1)
        ax.plot(trace["token"][31:], smooth.numpy(), lw=1.5, label="running mean (32)")
    ax.set(xlabel="token position", ylabel="KL(full || policy) nats", title=f"KL over steps: {title}")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
