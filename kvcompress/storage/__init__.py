"""Storages: how a layer holds the tokens its selector keeps; ``conf/storage/<name>.yaml`` is the registry."""

from kvcompress.storage.base import Storage, Store
from kvcompress.storage.dense import DenseStorage
from kvcompress.storage.low_rank import LowRankStorage
from kvcompress.storage.offload import OffloadStorage
from kvcompress.storage.quant import QuantStorage

__all__ = ["Storage", "Store", "DenseStorage", "LowRankStorage", "OffloadStorage", "QuantStorage"]
