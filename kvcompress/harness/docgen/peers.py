"""``peers FILE``: the agreement table of the differential test against kvpress, from the record of
``experiments/peers/record.py`` (``make test-peers``): per method, the kvpress press and our policy at the
settings that reproduce it, the kept-set Jaccard per (layer, KV head) over the prompts (mean and min), the
tokens each side kept, and how many greedy answers are equal. Dropped when the file is gone, unless the
marker says ``pending``.
"""

from __future__ import annotations

import json
from pathlib import Path


def _press(spec: dict) -> str:
    """``AdaKVPress(SnapKVPress(window_size=64, ...), alpha_safeguard=0.2)``, compression ratio left out."""
    args = [_press(spec["press"])] if "press" in spec else []
    args += [f"{k}={v}" for k, v in spec.items() if k not in ("name", "press")]
    return f"{spec['name']}({', '.join(args)})"


def _ours(spec: dict) -> str:
    """``snapkv observation_window=64 ...`` (a ``_target_``'s class name, an inner policy in braces)."""
    name = spec.get("name") or spec["_target_"].rsplit(".", 1)[-1]
    args = []
    for key, value in spec.items():
        if key in ("name", "_target_"):
            continue
        args.append(f"{key}={{{_ours(value)}}}" if isinstance(value, dict) else f"{key}={value}")
    return " ".join([name, *args])


def peers_row(name: str, row: dict) -> str:
    settings = row["settings"]
    cells = [
        f"`{name}`", f"`{_press(settings['press'])}`", f"`{_ours(settings['ours'])}`",
        f"{row['jaccard_mean']:.3f} / {row['jaccard_min']:.3f}",
        f"{row['kept_ours']} / {row['kept_kvpress']}", f"{row['answers_equal']} / {row['answers_compared']}",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def peers_block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    path = root / args[0]
    if not path.is_file():  # ``pending``: a place kept until ``make test-peers`` writes the record
        return (
            f"_No peer record yet at `{args[0]}`: `make test-peers` writes it._"
            if "pending" in args
            else None
        )
    record = json.loads(path.read_text())
    head = [
        "| method | kvpress press | kvcompress policy | Jaccard mean / min | tokens kept (ours / kvpress) "
        "| answers equal |",
        "|---|---|---|---|---|---|",
    ]
    rows = [peers_row(name, row) for name, row in record["methods"].items()]
    versions = record["peers_versions"]
    tokens = record["prompt_tokens"]
    note = (
        f"_`{args[0]}`: {record['model']}, {len(tokens)} needle prompts of "
        f"{min(tokens)}-{max(tokens)} tokens (question inside), compression "
        f"ratio {record['compression_ratio']}, kvpress {versions['kvpress']} with transformers "
        f"{versions['transformers']}; Jaccard over every (prompt, layer, KV head); answers compared where "
        f"kvpress could decode. Regenerate: `make test-peers` (runs it), `make results` (redraws it)._"
    )
    return "\n".join(head + rows) + "\n\n" + note
