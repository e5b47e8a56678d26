"""Why batching log-likelihoods gains less than the batch size on one CPU core: the embedded model's
linear shapes (SmolLM2-135M: attention, MLP and lm_head) at 1 and at 8 rows. Prints ms per set of one
product of each shape, the median of 3 repeats of 20.
Usage: ``OMP_NUM_THREADS=1 python experiments/speed/linear_batch.py``"""

from __future__ import annotations

import statistics
import time

import torch

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out); the last: lm_head


def ms_per_set(rows: int, weights: list) -> float:
    inputs = {i: torch.randn(rows, i) for i, _ in SHAPES}
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(20):
            for (i, _), w in zip(SHAPES, weights, strict=True):
                torch.nn.functional.linear(inputs[i], w)
        runs.append((time.perf_counter() - start) / 20 * 1e3)
    return statistics.median(runs)


if __name__ == "__main__":
    weights = [torch.randn(o, i) for i, o in SHAPES]
    one, eight = ms_per_set(1, weights), ms_per_set(8, weights)
    threads = torch.get_num_threads()
    print(f"threads {threads}: 1 row {one:.2f} ms, 8 rows {eight:.2f} ms ({eight / one:.2f}x)")
