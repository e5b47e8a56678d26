"""``policy=turboquant``: the ``full`` selector over rotated quantized storage (``storage.quant.turbo``).

Zandieh et al., TurboQuant, arXiv 2504.19874; the key sketch: QJL, arXiv 2406.03482.
"""

from __future__ import annotations

from kvcompress.selectors.full import StoragePreset, storage_preset
from kvcompress.storage.quant.turbo import TurboStorage


@storage_preset(TurboStorage)
class TurboQuantPolicy(StoragePreset):
    """Every token, rotated and stored as packed ``bits``-bit codes (its fields are ``TurboStorage``'s)."""

    FORMULA = True  # every token at its storage's bytes
    TEST_PARAMS = {"recent": 8}
    FUZZ = TurboStorage.FUZZ
    MEMORY_VARIANTS = [
        {"bits": 2, "group_size": 8, "recent": 20},
        {"bits": 8, "recent": 0, "sketch": False, "scale_dtype": "float32"},
    ]
