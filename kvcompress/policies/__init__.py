"""Selectors, one module each; ``conf/policy/<name>.yaml`` (its ``_target_``) is the registry."""

from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer
from kvcompress.policies.block_evict import BlockEvictPolicy
from kvcompress.policies.block_sparse import BlockSparsePolicy
from kvcompress.policies.eviction import EvictionPolicy
from kvcompress.policies.expected_attention import ExpectedAttentionPolicy
from kvcompress.policies.full import FullPolicy, StoragePreset
from kvcompress.policies.h2o import H2OPolicy
from kvcompress.policies.kvzip import KVzipPolicy
from kvcompress.policies.low_rank import LowRankPolicy
from kvcompress.policies.pyramid import PyramidKVPolicy
from kvcompress.policies.quant import QuantPolicy
from kvcompress.policies.schedule import SchedulePolicy
from kvcompress.policies.sliding_window import SlidingWindowPolicy
from kvcompress.policies.snapkv import SnapKVPolicy
from kvcompress.policies.tiered import TieredPolicy
from kvcompress.policies.tova import TOVAPolicy

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
