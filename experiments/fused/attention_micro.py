"""One decode query's attention on the embedded model's shape (9 query heads, 3 KV heads, head_dim 64):
torch's SDPA (what ``full`` and ``sliding_window`` use) against kvcompress's grouped decode attention
(``torch_attention.decode_attention``, what the score-based policies use), medians of 30 repeats of 20 calls.
Usage: ``OMP_NUM_THREADS=1 python experiments/fused/attention_micro.py``"""

from __future__ import annotations

import statistics
import time

import torch

from kvcompress.core.torch_attention import decode_attention


def median_us(fn, repeats: int = 30, calls: int = 20) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


@torch.inference_mode()
def main() -> None:
    q = torch.randn(1, 9, 1, 64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for tokens in (1024, 2052, 4100):
        k, v = torch.randn(1, 3, tokens, 64), torch.randn(1, 3, tokens, 64)
        a = median_us(lambda k=k, v=v: sdpa(q, k, v, enable_gqa=True))
        b = median_us(lambda k=k, v=v: decode_attention(q, k, v, 0.125))
        print(f"{tokens:5d} tokens: SDPA {a:6.1f} us, grouped {b:6.1f} us")


if __name__ == "__main__":
    main()
