"""Log-likelihood requests per second of model=kvcompress at batch_size 8 and 1, and their scores.

Eight essay slices of different lengths (192 down to 150 tokens, so batches are padded) are scored by the
adapter's own ``_loglikelihood_tokens`` at each batch size, one token per forward; prints CPU and wall
seconds of the scoring alone (model loading excluded), their ratios and the largest difference between the
two runs' log-likelihoods. CPU seconds are the steadier number on a machine shared with other work.

Usage: OMP_NUM_THREADS=1 nice -n 10 python benchmarks/lm_eval_batching.py [--policy sliding_window]
"""

from __future__ import annotations

import argparse
import json
import time

from kvcompress.eval.adapter import KVCompressLM
from kvcompress.resources.data import load_text

LENGTHS = (192, 186, 180, 175, 168, 162, 156, 150)


def requests(lm) -> list:
    ids, out, start = lm.tok_encode(load_text("pg_essays")[:20000]), [], 0
    for n in LENGTHS:  # one context token, then n scored tokens
        out.append((("", ""), ids[start : start + 1], ids[start + 1 : start + 1 + n]))
        start += n + 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="sliding_window")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    extra = {"sink_tokens": 4, "window": 64} if args.policy == "sliding_window" else {}
    lm = KVCompressLM(pretrained="smollm2-135m", device="cpu", policy=args.policy, chunk_size=1, **extra)
    reqs, runs = requests(lm), {}
    for size in (args.batch, 1):
        lm.batch_size_per_gpu = size
        cpu, wall = time.process_time(), time.perf_counter()
        scores = [ll for ll, _ in lm._loglikelihood_tokens(reqs, disable_tqdm=True)]
        runs[size] = (time.process_time() - cpu, time.perf_counter() - wall, scores)
    (cpu_b, wall_b, ll_b), (cpu_1, wall_1, ll_1) = runs[args.batch], runs[1]
    print(json.dumps({
        f"cpu_s_batch{args.batch}": cpu_b, "cpu_s_batch1": cpu_1, "cpu_ratio": cpu_1 / cpu_b,
        f"wall_s_batch{args.batch}": wall_b, "wall_s_batch1": wall_1, "wall_ratio": wall_1 / wall_b,
        "max_abs_loglikelihood_diff": max(abs(a - b) for a, b in zip(ll_b, ll_1, strict=True)),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
