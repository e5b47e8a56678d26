"""Perplexity over several text slices with an interval that stays above zero: computed on log perplexity
(the NLL), where slices add, and mapped back; also applied to records read back that were written when the
interval was a t-interval on the perplexities themselves (``kvcompress.harness.results.current_record``)."""

from __future__ import annotations

from kvcompress.metrics.stats import interval_fields, log_interval, t_interval


def perplexity_fields(per_slice: list[dict]) -> dict:
    """``perplexity`` and ``nll`` over slices with their 95% intervals: ``nll`` the mean and t-interval of the
    slices' NLLs, ``perplexity`` the geometric mean of theirs (``exp`` of the mean NLL: the perplexity of the
    slices pooled, equal lengths) with ``log_interval``, so the interval stays above zero."""
    nll = t_interval([s["nll"] for s in per_slice])
    ppl = log_interval([s["perplexity"] for s in per_slice])
    return {
        "perplexity": ppl["mean"],
        **interval_fields("perplexity", ppl["low"], ppl["high"]),
        "nll": nll["mean"],
        **interval_fields("nll", nll["low"], nll["high"]),
    }


def current_perplexity(metrics: dict) -> dict:
    """``metrics`` of a record read back with its perplexity fields recomputed from its own slices by today's
    method (``perplexity_fields``): a record written when the interval was a t-interval on the perplexities
    themselves (which could cross zero) reads as one written today. Metrics without per-slice perplexity
    and NLL are returned unchanged; the file is never rewritten."""
    slices = metrics.get("slices") if isinstance(metrics, dict) else None
    if "perplexity" not in (metrics or {}) or not isinstance(slices, list) or not slices:
        return metrics
    numbers = (int, float)
    usable = all(
        isinstance(s, dict) and isinstance(s.get("nll"), numbers) and isinstance(s.get("perplexity"), numbers)
        and 0 < s["perplexity"] < float("inf")
        for s in slices
    )  # fmt: skip
    return {**metrics, **perplexity_fields(slices)} if usable else metrics
