"""A frontier search's trials (``sweep=frontier_*``) scored as leaderboard points, each paired with ``full``.

A trial's record is named by its run folder, the overrides the search drew (``policy.retrieval_ratio=0.44,
storage.bits=4``). Each is paired with the leaderboard's ``full`` record of the same question mode on the
samples both answered (``leaderboard.row``); a trial is *within 5%* of ``full`` when that paired difference
is inside the noise and its mean is no lower than 5% of ``full``'s score on the same samples. The Pareto set
is the trials no other beats on both score and bytes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from kvcompress.harness import leaderboard as lb

WITHIN = 0.05  # the largest loss against full, as a share of full's score, a frontier point may have


def trial_name(run_dir: str) -> str:
    """``retrieval_ratio=0.442, bits=4`` from ``policy.retrieval_ratio=0.44208472,storage.bits=4``."""
    parts = []
    for item in Path(run_dir).name.split(","):
        key, _, value = item.partition("=")
        if re.fullmatch(r"-?\d+\.\d+(e-?\d+)?", value):
            value = f"{float(value):.3g}"
        parts.append(f"{key.rsplit('.', 1)[-1]}={value}")
    return ", ".join(parts)


def trials(records: list[dict]) -> list[lb.Point]:
    """The finished trials among ``records`` with scored samples, named by their drawn overrides."""
    found = []
    for record in records:
        point = lb.from_record(record, name=trial_name(record.get("run_dir", "")))
        if point is not None and point.scores:
            method = f"{record.get('policy_name')} / {record.get('storage')}"
            found.append(dataclasses.replace(point, method=method))
    return found


def _full_share(point: lb.Point, full: lb.Point) -> float:
    """``full``'s score on the samples ``point`` shares with it (the base of the 5% rule)."""
    shared = lb.shared_samples(point, full)
    return lb.task_mean(np.array([full.scores[k] for k in shared]), shared) if shared else 0.0


def _beats(a: dict, b: dict) -> bool:
    """``a`` scores no lower and holds no more bytes than ``b``, and differs on one of the two."""
    return (
        a["score"] >= b["score"]
        and a["bytes"] <= b["bytes"]
        and (a["score"], a["bytes"]) != (b["score"], b["bytes"])
    )


def rows(found: list[lb.Point], fulls: list[lb.Point]) -> list[dict]:
    """Every trial's leaderboard row, plus ``within`` (the 5% rule) and ``pareto``; fewest bytes first."""
    full = {p.question_in_prompt: p for p in fulls if p.name == "full"}
    out = []
    for point in found:
        ref = full.get(point.question_in_prompt)
        r = lb.row(point, ref)
        r["within"] = (
            r["compressed"] and "diff" in r and r["noise"] and r["diff"] >= -WITHIN * _full_share(point, ref)
        )  # a trial whose policy never acted (flagged) is no frontier point, whatever it scored
        out.append(r)
    for r in out:
        r["pareto"] = not any(_beats(o, r) for o in out if o["mode"] == r["mode"])
    return sorted(out, key=lambda r: (r["mode"] != lb.MODES[True], r["bytes"], r["point"]))


def markdown(table_rows: list[dict]) -> str:
    """The trials' table: bytes, score and the paired difference from ``full``, the 5% rule, the set."""
    head = (
        "| mode | trial | samples | bytes held / full | score [95%] | vs full, paired [95%] | within 5% "
        "| Pareto |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in table_rows:
        versus = ""
        if "diff" in r:
            versus = lb.cell(r["diff"], r["diff_low"], r["diff_high"], signed=True) + f" (n={r['paired']})"
        lines.append(
            f"| {r['mode']} | {r['method']}: {r['point']} | {r['samples']} | {r['bytes']:.3f} | "
            f"{lb.cell(r['score'], r['score_low'], r['score_high'])} | {versus} | "
            f"{'yes' if r['within'] else 'no' if r['compressed'] else '**did not compress**'} | "
            f"{'yes' if r['pareto'] else ''} |"
        )
    return "\n".join(lines)
