"""The perplexity table of this experiment, from the results.json records under a folder (never retyped).

Each row: the run, what its low-rank cache stores, perplexity and its ratio to ``full`` run on the same
tokens (same ``prefix_tokens``), per-token cache bytes (bases left out) as a share of ``full``'s and per
token over all layers, and the bases (a per-model constant) apart.

Usage: python experiments/low_rank_prerope/table.py experiments/low_rank_prerope/runs
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvcompress.harness.report import collect


def describe(policy: dict) -> str:
    """What the cache stores, in a few words."""
    if not policy.get("_target_", "").endswith("LowRankPolicy"):
        return "full"
    keys = f"keys {policy.get('keys', 'post_rope')} {policy.get('basis', 'head')} r{policy['rank']}"
    keys += f" ({policy.get('key_objective', 'keys')})"
    if policy.get("allocation", "uniform") != "uniform":
        keys += f" alloc={policy['allocation']}"
    values = policy.get("values")
    values = {"name": values} if isinstance(values, str) else values
    if values is None:
        values = f"values r{policy.get('value_rank') or policy['rank']}"
    elif values.get("name") == "quant":
        values = (
            f"values int{values.get('bits', 4)} r{values.get('recent', values.get('residual_length', 128))}"
        )
    else:
        values = f"values {values['name']}"
    int8 = ", int8 coefficients" if policy.get("int8_coefficients") else ""
    return f"{keys} + {values}{int8}"


def rows(records: list[dict]) -> list[dict]:
    ok = [r for r in records if r.get("status") == "ok" and "perplexity" in r.get("metrics", {})]
    full = {r["metrics"].get("prefix_tokens"): r["metrics"]["perplexity"] for r in ok if describe(
        r["config"]["policy"]) == "full"}  # fmt: skip
    out = []
    for r in ok:
        m = r["metrics"]
        tokens = m["tokens_scored"] + (m.get("prefix_tokens") or 0)  # tokens the cache consumed
        per_token = (m["cache_bytes"] - m.get("fixed_bytes", 0)) / tokens
        base = full.get(m.get("prefix_tokens"))
        out.append({
            "run": Path(r.get("run_dir", "?")).name,
            "stores": describe(r["config"]["policy"]),
            "prefix": m.get("prefix_tokens") or 0,
            "scored": m["tokens_scored"],
            "perplexity": f"{m['perplexity']:.2f}",
            "x full": f"{m['perplexity'] / base:.3f}" if base else "",
            "per-token bytes / full": f"{m.get('per_token_cache_ratio', m['cache_ratio']):.3f}",
            "bytes / token": f"{per_token:,.0f}",
            "bases MB": f"{m.get('fixed_bytes', 0) / 1e6:.2f}",
        })  # fmt: skip
    return sorted(out, key=lambda row: (row["prefix"], row["stores"] != "full", row["run"]))


def main(argv=None) -> int:
    root = Path((argv or sys.argv[1:])[0])
    table = rows(collect(root))
    cols = list(table[0]) if table else []
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    print("\n".join("| " + " | ".join(str(row[c]) for c in cols) + " |" for row in table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
