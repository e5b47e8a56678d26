"""``policy=quant``: the ``full`` selector over KIVI storage (``kvcompress.storage.quant.kivi``).

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750.
"""

from __future__ import annotations

from kvcompress.selectors.full import StoragePreset, storage_preset
from kvcompress.storage.quant.kivi import QuantStorage


@storage_preset(QuantStorage)
class QuantPolicy(StoragePreset):
    """Every token, stored as packed ``bits``-bit codes (its fields are ``QuantStorage``'s)."""

    FORMULA = True  # the inherited memory formulas (every token, its storage's bytes) describe it exactly
    TEST_PARAMS = {"group_size": 4, "recent": 8}
    FUZZ = QuantStorage.FUZZ
    MEMORY_VARIANTS = [
        {"bits": 2, "group_size": 8, "recent": 20, "key_axis": "token"},
        {"bits": 8, "group_size": 16, "recent": 0, "scale_dtype": "float32"},
    ]
