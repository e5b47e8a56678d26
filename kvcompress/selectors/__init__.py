"""Selectors, one module each; ``conf/policy/<name>.yaml`` (its ``_target_``) is the registry."""

from kvcompress.core.policy import ModelSpec, Policy, PolicyLayer
from kvcompress.selectors.eviction.base import EvictionPolicy
from kvcompress.selectors.eviction.block_evict import BlockEvictPolicy
from kvcompress.selectors.eviction.expected_attention import ExpectedAttentionPolicy
from kvcompress.selectors.eviction.h2o import H2OPolicy
from kvcompress.selectors.eviction.kvzip import KVzipPolicy
from kvcompress.selectors.eviction.pyramid import PyramidKVPolicy
from kvcompress.selectors.eviction.snapkv import SnapKVPolicy
from kvcompress.selectors.eviction.tova import TOVAPolicy
from kvcompress.selectors.full import FullPolicy, StoragePreset
from kvcompress.selectors.low_rank import LowRankPolicy
from kvcompress.selectors.pages.block_sparse import BlockSparsePolicy
from kvcompress.selectors.pages.tiered import TieredPolicy
from kvcompress.selectors.quant import QuantPolicy
from kvcompress.selectors.schedule import SchedulePolicy
from kvcompress.selectors.sliding_window import SlidingWindowPolicy

__all__ = [
    "ModelSpec",
    "Policy",
    "PolicyLayer",
    "FullPolicy",
    "StoragePreset",
    "QuantPolicy",
    "SchedulePolicy",
    "SlidingWindowPolicy",
    "EvictionPolicy",
    "H2OPolicy",
    "ExpectedAttentionPolicy",
    "KVzipPolicy",
    "PyramidKVPolicy",
    "SnapKVPolicy",
    "TOVAPolicy",
    "BlockSparsePolicy",
    "BlockEvictPolicy",
    "TieredPolicy",
    "LowRankPolicy",
]
