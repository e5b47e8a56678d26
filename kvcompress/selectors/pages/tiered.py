"""Tiered KV cache: Quest page selection over a cold tier in host memory or on disk.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774;
the tiers as in InfLLM (arXiv 2402.04617) and ShadowKV (arXiv 2410.21465).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvcompress.core.fields import Float, Int
from kvcompress.core.policy import Policy
from kvcompress.selectors.pages.tiered_layer import TieredLayer


@dataclass
class TieredPolicy(Policy):
    """Every step (each decode token and each query chunk of a prefill) scores the cold pages of its
    ``offload`` store by Quest's bound over their key min/max, per KV head, and attends over the hot tokens
    (sinks, recent window) plus the best pages, fetched back through the device LRU. Nothing is evicted:
    a question asked after the context can still reach any page.

    Args:
        top_k_blocks: cold pages read per step and KV head, sink pages included.
        read_ratio: if set, ``ceil(read_ratio * cold pages)`` instead (capped by the storage's ``lru_pages``).
        sink_blocks: first pages of real tokens always read.
        prefill_chunk: tokens per forward when a task prefills a prompt (``context_pass.forward_prompt``), so
            device bytes peak at the hot budget plus one chunk.
    """

    layer_class = TieredLayer
    reads_pages = True  # what the offload storage serves
    MAX_MEMORY_RATIO = 1.6  # short test sequences: page summaries and fetched pages next to the window
    TEST_PARAMS = {
        "top_k_blocks": 2,
        "prefill_chunk": 16,
        "storage": {"name": "offload", "block_size": 4, "recent": 8, "lru_pages": 3},
    }
    FUZZ = {"top_k_blocks": (1, 6), "sink_blocks": (0, 2), "prefill_chunk": (1, 64)}

    top_k_blocks: int = Int(38, low=1)
    read_ratio: float | None = Float(None, 0.0, 1.0, low_open=True, null=True)
    sink_blocks: int = Int(1, low=0)
    prefill_chunk: int = Int(256, low=1)

    def __post_init__(self):
        if self.storage is None:
            self.storage = {"name": "offload"}
        super().__post_init__()

    def refuses_storage(self, storage) -> str | None:
        if storage.name == "offload":
            return None
        why = "tiered fetches pages from the cold tier of an offload storage"
        return f"{why}; use storage=offload (tier host or disk)"

    def check(self, spec) -> None:
        super().check(spec)  # the refusal first: only an offload storage has lru_pages
        if self.top_k_blocks > self.storage.lru_pages:
            raise ValueError(
                f"tiered.top_k_blocks={self.top_k_blocks} must be <= storage.lru_pages="
                f"{self.storage.lru_pages}: the pages a step reads must fit on the device together"
            )
        if self.top_k_blocks < self.sink_blocks:
            raise ValueError(
                f"tiered.top_k_blocks={self.top_k_blocks} must be >= sink_blocks={self.sink_blocks}"
            )

    def covering(self, n_tokens: int) -> TieredPolicy:
        pages = n_tokens // self.storage.block_size + 2
        wider = super().covering(n_tokens)
        return dataclasses.replace(wider, top_k_blocks=max(self.top_k_blocks, pages), read_ratio=None)
