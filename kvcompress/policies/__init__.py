"""Policy families, one module each; ``conf/policy/<name>.yaml`` plus this export line is the registry."""

from kvcompress.policies.base import ModelSpec, Policy, PolicyLayer
from kvcompress.policies.block_sparse import BlockSparsePolicy
from kvcompress.policies.full import FullPolicy
from kvcompress.policies.low_rank import LowRankPolicy
from kvcompress.policies.schedule import SchedulePolicy
from kvcompress.policies.sliding_window import SlidingWindowPolicy

__all__ = [
    "BlockSparsePolicy",
    "FullPolicy",
    "LowRankPolicy",
    "ModelSpec",
    "Policy",
    "PolicyLayer",
    "SchedulePolicy",
    "SlidingWindowPolicy",
]
