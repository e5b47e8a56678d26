"""``policy=low_rank``: the ``full`` selector over low-rank storage (``kvcompress.storage.low_rank.storage``).

After Palu (Chang et al., arXiv 2407.21118): a low-rank latent of pre-RoPE keys cached, re-rotated on read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.fields import Bool, Choice, Float, Int
from kvcompress.kernels.fused_low_rank import MODES
from kvcompress.selectors.full import StoragePreset
from kvcompress.storage.low_rank.bases import BLOCKS
from kvcompress.storage.low_rank.storage import OBJECTIVES, SOURCES, LowRankStorage


@dataclass
class LowRankPolicy(StoragePreset):
    """Every token, older ones as rank-``rank`` coefficients (fields as ``LowRankStorage``)."""

    storage_class = LowRankStorage
    FORMULA = True  # the memory formulas below are this class's own
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

    rank: int | None = Int(None, low=1, null=True)  # null with energy null: 32
    value_rank: int | None = Int(None, low=1, null=True)
    energy: float | None = Float(None, 0, 1, low_open=True, null=True)
    allocation: str = Choice("uniform", ("uniform", "error"))
    keys: str = Choice("pre_rope", tuple(SOURCES))
    key_objective: str = Choice("logits", OBJECTIVES)
    basis: str = Choice("joint", BLOCKS)
    group_size: int = Int(2, low=1)
    values: object = None
    recent: int = Int(0, low=0)
    int8_coefficients: bool = Bool(False)
    calibration_text: str = "pg_essays"
    calibration_tokens: int = Int(2048, low=1)
    calibration_dir: str | None = None
    tokenizer: object = None
    fused_attention: str = Choice("auto", MODES)

    @property
    def calibration(self) -> dict:
        return self.storage.calibration

    def describe(self) -> dict:
        own = self.storage.describe()
        return {**super().describe(), "values": own["values"], "tokenizer": own["tokenizer"]}
