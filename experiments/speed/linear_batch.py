"""Why batching log-likelihoods gained less than the batch size on one CPU core: the embedded model's
linear shapes (SmolLM2-135M: attention, MLP and lm_head) at 1 and at 8 rows, by the default BLAS path
(``nn.functional.linear``, which packs the whole weight at every call with more than one row) and by
``PackedLinear`` (``model.linears=packed``: oneDNN on a weight packed once). Prints ms per set of one product
of each shape, the median of 3 repeats of 20.
Usage: ``OMP_NUM_THREADS=1 python experiments/speed/linear_batch.py``"""

from __future__ import annotations

import statistics
import time

import torch

from kvcompress.resources.packed_linears import PackedLinear

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out); the last: lm_head


def ms_per_set(rows: int, layers: list) -> float:
    inputs = {i: torch.randn(rows, i) for i, _ in SHAPES}
    runs = []
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(20):
                for (i, _), layer in zip(SHAPES, layers, strict=True):
                    layer(inputs[i])
            runs.append((time.perf_counter() - start) / 20 * 1e3)
    return statistics.median(runs)


if __name__ == "__main__":
    plain = [torch.nn.Linear(i, o, bias=False) for i, o in SHAPES]
    paths = {"default": plain, "packed": [PackedLinear(layer) for layer in plain]}
    threads = torch.get_num_threads()
    for name, layers in paths.items():
        one, eight = ms_per_set(1, layers), ms_per_set(8, layers)
        print(f"{name}, threads {threads}: 1 row {one:.2f} ms, 8 rows {eight:.2f} ms ({eight / one:.2f}x)")
