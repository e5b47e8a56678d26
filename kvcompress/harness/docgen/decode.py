"""``decode FILE [names=a,b] [columns=a,b]``: a table from a record of
``experiments/fused/decode_speed.py`` (interleaved decode rounds in one process, ratios to ``full`` taken
round by round): per contender the median ratio by wall time and by CPU time with their ranges over the
rounds, the policy overhead and the cache's MiB. Dropped when the file is gone.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvcompress.harness.report import markdown_table

COLUMNS = "cache,vs_full,vs_full_cpu,policy_overhead,cache_mib"
PAIRED = "; each ratio is to a `full` measurement made just before it (`--paired`)"


def decode_row(name: str, result: dict) -> dict:
    """One contender's row: medians with their ``_min``/``_max`` over the rounds."""
    row = {"cache": name, "policy_overhead": result["policy_overhead_median"],
           "cache_mib": result["cache_bytes"] / 2**20}  # fmt: skip
    for key in ("vs_full", "vs_full_cpu", "decode_tok_s"):
        if f"{key}_median" not in result:  # older records: no CPU time
            continue
        low, high = result[f"{key}_min"], result[f"{key}_max"]
        row |= {key: result[f"{key}_median"], f"{key}_min": low, f"{key}_max": high}
    return row


def decode_block(args: list[str], options: dict, root: Path, md_path: Path) -> str | None:
    path = root / args[0]
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    results = record["results"]
    names = options["names"].split(",") if "names" in options else list(results)
    if missing := [n for n in names if n not in results]:
        raise ValueError(f"decode block in {md_path}: {missing} not in {args[0]}; it has {list(results)}")
    rows = [decode_row(name, results[name]) for name in names]
    env = record["env"]
    load = env["loadavg_before"][0], env["loadavg_after"][0]
    note = (
        f"_`{args[0]}`: context {record['context']}, {record['rounds']} rounds of "
        f"{record['steps_per_round']} steps, {record['dtype']}, OMP_NUM_THREADS="
        f"{env['OMP_NUM_THREADS']}, load average {load[0]:.1f} before and {load[1]:.1f} after; "
        f"ranges are over the rounds{PAIRED if record.get('paired') else ''}. Regenerate: `make results`._"
    )
    columns = [c for c in options.get("columns", COLUMNS).split(",") if any(c in r for r in rows)]
    return markdown_table(rows, columns) + "\n\n" + note
