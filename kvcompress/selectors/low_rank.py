"""``policy=low_rank``: the ``full`` selector over low-rank storage (``kvcompress.storage.low_rank.storage``).

After Palu (Chang et al., arXiv 2407.21118): a low-rank latent of pre-RoPE keys cached, re-rotated on read.
"""

from __future__ import annotations

from kvcompress.selectors.full import StoragePreset, storage_preset
from kvcompress.storage.low_rank.storage import LowRankStorage


@storage_preset(LowRankStorage)
class LowRankPolicy(StoragePreset):
    """Every token, older ones as rank-``rank`` coefficients (its fields are ``LowRankStorage``'s)."""

    FORMULA = True  # the inherited memory formulas (every token, its storage's bytes) describe it exactly
    TEST_PARAMS = {"rank": 4, "recent": 4, "calibration_text": "random", "calibration_tokens": 64}
    FUZZ = LowRankStorage.FUZZ
    MEMORY_VARIANTS = [
        {
            "rank": 5,
            "value_rank": 9,
            "recent": 0,
            "calibration_text": "random",
            "calibration_tokens": 64,
        },
        {
            "rank": 6,
            "recent": 40,
            "int8_coefficients": True,
            "calibration_text": "random",
            "calibration_tokens": 64,
        },
        {
            "rank": 5,
            "basis": "head",
            "keys": "post_rope",
            "calibration_text": "random",
            "calibration_tokens": 64,
        },
        {
            "rank": 4,
            "values": {"name": "quant", "bits": 4, "group_size": 8, "recent": 16},
            "calibration_text": "random",
            "calibration_tokens": 64,
        },
        {
            "rank": 3,
            "basis": "group",
            "recent": 10,
            "values": "dense",
            "calibration_text": "random",
            "calibration_tokens": 64,
        },
    ]

    @property
    def calibration(self) -> dict:
        return self.storage.calibration

    def describe(self) -> dict:
        own = self.storage.describe()
        return {**super().describe(), "values": own["values"], "tokenizer": own["tokenizer"]}
