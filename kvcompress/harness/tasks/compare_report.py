"""What ``kvcompress compare`` reports: the first divergence, the weakest layers, the dropped text."""

from __future__ import annotations

CONTEXT = 6  # tokens shown either side of a dropped position


def diagnose(gen: dict, prompt_ids: list[int], tokenizer, cfg, needle: tuple[int, int] | None) -> dict:
    """Summary of a ``compare.generate`` result at its first divergence (or last probed step).

    ``lowest_layers``: [layer, mean recall over KV heads, per-head recalls]. ``dropped_positions``: the
    positions with the most attention mass full put there and the policy had dropped, as the mean over
    layers and KV heads of that mass, with the token and its surrounding text.
    """
    first, probe = gen["first_divergence"], gen["probe"]
    n_same = len(gen["full"]) if first is None else first
    ids = prompt_ids + [t for t in gen["full"][:n_same] if t is not None]
    out = {"first_divergence": first, "prompt_tokens": gen["prompt_tokens"], "steps": _steps(gen, tokenizer)}
    if probe is None:
        return out
    recall = probe["recall"]  # (L, H_kv)
    order = recall.mean(-1).argsort()[: cfg.get("top_layers", 5)].tolist()
    out["probed_step"] = first if first is not None else n_same - 1
    out["recall_mean"] = float(recall.mean())
    out["lowest_layers"] = [
        [i, float(recall[i].mean()), [round(float(r), 4) for r in recall[i]]] for i in order
    ]
    dropped = probe["dropped"].mean((0, 1))  # (seen,) mean over layers and heads
    top = dropped.topk(min(cfg.get("top_positions", 10), dropped.shape[-1]))
    out["dropped_mass"] = float(dropped.sum())
    out["dropped_positions"] = [
        _position(tokenizer, ids, int(p), float(m))
        for m, p in zip(top.values, top.indices, strict=True)
        if m > 0
    ]
    if needle is not None:
        out["needle"] = _needle(probe, needle)
    return out


def _needle(probe: dict, span: tuple[int, int]) -> dict:
    """Full's attention on the needle's tokens and the part the policy held (mean over layers and heads)."""
    a, b = span
    full = probe["attention"][..., a:b].sum(-1)  # (L, H_kv)
    held = full - probe["dropped"][..., a:b].sum(-1)
    layer = int(full.mean(-1).argmax())
    return {
        "span": [a, b],
        "full_mass": float(full.mean()),
        "held_mass": float(held.mean()),
        "top_layer": layer,
        "top_layer_full_mass": float(full[layer].mean()),
        "top_layer_held_mass": float(held[layer].mean()),
    }


def _position(tokenizer, ids: list[int], p: int, mass: float) -> dict:
    return {"position": p, "mass": mass, "token": _tok(tokenizer, ids, p), "text": _around(tokenizer, ids, p)}


def _tok(tokenizer, ids: list[int], p: int) -> str:
    return tokenizer.decode(ids[p : p + 1]) if p < len(ids) else "?"


def _around(tokenizer, ids: list[int], p: int) -> str:
    left = tokenizer.decode(ids[max(p - CONTEXT, 0) : p])
    right = tokenizer.decode(ids[p + 1 : p + 1 + CONTEXT])
    return (left + "[[" + _tok(tokenizer, ids, p) + "]]" + right).replace("\n", " ")


def _steps(gen: dict, tokenizer) -> list[dict]:
    show = lambda t: "(end)" if t is None else tokenizer.decode([t])  # noqa: E731
    pairs = enumerate(zip(gen["full"], gen["policy"], strict=True))
    return [
        {"step": i, "full": show(f), "policy": show(p), "kl": gen["kl"][i], "recall": gen["recall"][i]}
        for i, (f, p) in pairs
    ]


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}"


def markdown(report: dict) -> str:
    """The side-by-side table and the diagnosis as Markdown."""
    first = report["first_divergence"]
    lines = ["| step | full | policy | KL(full‖policy) | recall |", "|---|---|---|---|---|"]
    for r in report["steps"]:
        mark = " **≠**" if r["step"] == first else ""
        cells = [f"{r['step']}{mark}", f"`{r['full']!r}`", f"`{r['policy']!r}`"]
        cells += [_fmt(r["kl"]), _fmt(r["recall"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"full: {report.get('full_response', '')!r}"]
    lines += [f"policy: {report.get('policy_response', '')!r}"]
    lines.append(
        "no divergence (probed: the last step)" if first is None else f"first divergence: step {first}"
    )
    return "\n".join(lines + _diagnosis(report))


def _diagnosis(report: dict) -> list[str]:
    lines = []
    if "lowest_layers" in report:
        layers = ", ".join(f"{i} ({r:.3f})" for i, r, _ in report["lowest_layers"])
        lines += [
            f"attention recall there: {report['recall_mean']:.4f} (mean over layers and KV heads)",
            f"lowest-recall layers: {layers}",
            "",
            "positions full attended to that the policy had dropped (full's mass, mean over layers, heads):",
        ]
        lines += [f"- {d['position']}: {d['mass']:.4f} …{d['text']}…" for d in report["dropped_positions"]]
    if "needle" in report:
        n = report["needle"]
        lines += [
            "",
            f"needle tokens {n['span']}: full's attention on them {n['full_mass']:.4f} (mean over layers and "
            f"heads), held by the policy {n['held_mass']:.4f}; layer {n['top_layer']}, the one most on the "
            f"needle: {n['top_layer_full_mass']:.4f}, held {n['top_layer_held_mass']:.4f}",
        ]
    return lines
