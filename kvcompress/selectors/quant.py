"""``policy=quant``: the ``full`` selector over KIVI storage (``kvcompress.storage.quant.kivi``).

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.fields import Choice, Int
from kvcompress.kernels.fused_quant import MODES
from kvcompress.selectors.full import StoragePreset
from kvcompress.storage.quant.kivi import SCALE_DTYPES, QuantStorage
from kvcompress.storage.quant.quantizer import AXES, BITS


@dataclass
class QuantPolicy(StoragePreset):
    """Every token, stored as packed ``bits``-bit codes (fields as ``QuantStorage``)."""

    storage_class = QuantStorage
    FORMULA = True  # the memory formulas below are this class's own
    TEST_PARAMS = {"group_size": 4, "recent": 8}
    FUZZ = QuantStorage.FUZZ
    MEMORY_VARIANTS = [
        {"bits": 2, "group_size": 8, "recent": 20, "key_axis": "token"},
        {"bits": 8, "group_size": 16, "recent": 0, "scale_dtype": "float32"},
    ]

    bits: int = Choice(4, BITS)
    group_size: int = Int(32, low=1)
    recent: int = Int(128, low=0)
    key_axis: str = Choice("channel", AXES)
    value_axis: str = Choice("token", AXES)
    scale_dtype: str = Choice("auto", tuple(SCALE_DTYPES))
    fused_attention: str = Choice("auto", MODES)
