"""Storages: how a layer holds the tokens its selector keeps; ``conf/storage/<name>.yaml`` is the registry."""

from kvcompress.core.storage import Storage, Store
from kvcompress.storage.dense import DenseStorage
from kvcompress.storage.low_rank.storage import LowRankStorage
from kvcompress.storage.offload.storage import OffloadStorage
from kvcompress.storage.quant.kivi import QuantStorage
from kvcompress.storage.quant.turbo import TurboStorage

__all__ = [
    "Storage",
    "Store",
    "DenseStorage",
    "LowRankStorage",
    "OffloadStorage",
    "QuantStorage",
    "TurboStorage",
]
