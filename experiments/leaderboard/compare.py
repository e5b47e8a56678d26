"""Paired differences between leaderboard points, in each question mode, from the committed records.

``row(a, b)`` of ``kvcompress.harness.leaderboard`` pairs ``a`` with ``b`` on the samples both answered, as
the table pairs every point with ``full``; a difference whose 95% interval holds 0 is inside the noise.

    .venv/bin/python experiments/leaderboard/compare.py kvzip_r75 snapkv_r75 tova_r75 quant_int4
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from kvcompress.harness import leaderboard as lb

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("points", nargs="+", help="kvcompress/conf/point names, best first")
    args = ap.parse_args()
    found = {(p.name, p.question_in_prompt): p for p in lb.load(ROOT)}
    unknown = sorted(set(args.points) - {name for name, _ in found})
    if unknown:
        ap.error(f"no leaderboard record for {unknown}; recorded points: {sorted({n for n, _ in found})}")
    for mode in (True, False):
        print(f"{lb.MODES[mode]}:")
        have = [found[name, mode] for name in args.points if (name, mode) in found]
        for a, b in itertools.combinations(have, 2):
            r = lb.row(a, b)
            if "diff" not in r:
                continue
            verdict = "inside the noise" if r["noise"] else ("better" if r["diff"] > 0 else "worse")
            if r["diff_low"] == r["diff_high"] == 0:
                verdict = "identical on these samples"
            print(
                f"  {a.name} - {b.name}: {r['diff']:+.3f} [{r['diff_low']:+.3f}, {r['diff_high']:+.3f}] "
                f"(n={r['paired']}): {verdict}"
            )


if __name__ == "__main__":
    main()
