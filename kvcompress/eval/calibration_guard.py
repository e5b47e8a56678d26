"""Evaluation never reads calibration text: lm-eval requests whose document records the characters it reads
(``text``, ``span``: the offline tasks' documents do) are refused when a policy calibrated on them."""

from __future__ import annotations

from kvcompress.storage.low_rank.calibration_text import check_disjoint


class CalibrationGuard:
    """Mixin of ``KVCompressLM``: checks every request's document against ``calibration_ranges`` (set by the
    model from its policy's calibration) before lm-eval's own handling."""

    calibration_ranges: list[dict] = []

    def refuse_calibration_text(self, requests) -> None:
        for req in requests:
            doc = getattr(req, "doc", None)
            if isinstance(doc, dict) and "span" in doc and "text" in doc:
                name = doc.get("id", doc.get("title"))
                what = f"lm-eval task {req.task_name!r} document {name!r}"
                check_disjoint(self.calibration_ranges, doc["text"], tuple(doc["span"]), what)

    def loglikelihood(self, requests, *args, **kwargs):
        self.refuse_calibration_text(requests)
        return super().loglikelihood(requests, *args, **kwargs)

    def loglikelihood_rolling(self, requests, *args, **kwargs):
        self.refuse_calibration_text(requests)
        return super().loglikelihood_rolling(requests, *args, **kwargs)

    def generate_until(self, requests, *args, **kwargs):
        self.refuse_calibration_text(requests)
        return super().generate_until(requests, *args, **kwargs)
