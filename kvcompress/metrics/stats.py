"""Intervals on every number: a t-interval over text slices, computed on the logarithm for a positive
quantity (perplexity) so it never crosses zero, Wilson intervals for accuracies, the median and
interquartile range for speed, and a comparison that calls overlapping intervals what they are.

No SciPy: the t quantiles for small samples are a table, larger ones an asymptotic expansion.
"""

from __future__ import annotations

import math
import statistics

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile
# Student's t 0.975 quantiles for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t975(df: int) -> float:
    """Student's t quantile at 0.975 for ``df`` degrees of freedom (two-sided 95%)."""
    if df < 1:
        raise ValueError(f"t975: df={df} must be >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z95  # Cornish-Fisher expansion in 1/df: within 1e-4 of the exact value above 30
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: list[float]) -> dict:
    """Mean and 95% t-interval over independent samples (text slices): ``{mean, low, high, n}``.

    One sample has no spread to estimate: its interval is ``None`` on both sides, never zero."""
    n = len(values)
    if n == 0:
        raise ValueError("t_interval: no values")
    mean = sum(values) / n
    if n == 1:
        return {"mean": mean, "low": None, "high": None, "n": 1}
    half = t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def log_interval(values: list[float]) -> dict:
    """Geometric mean and 95% interval of a positive quantity: the t-interval of ``log(values)``, mapped back
    by ``exp`` (``{mean, low, high, n}``).

    A t-interval on the values themselves can cross zero when slices differ a lot (perplexities 2, 3 and 60
    give ``[-60.8, 104.1]``); on the log scale, where such a quantity is additive (log perplexity is the mean
    NLL), the interval is ``[gm / f, gm * f]``: positive and asymmetric. Values must all be > 0."""
    bad = [v for v in values if not (isinstance(v, (int, float)) and 0 < v < math.inf)]
    if bad:
        raise ValueError(f"log_interval: values must be finite and > 0 (a positive quantity); got {bad}")
    ci = t_interval([math.log(v) for v in values])
    low, high = (None, None) if ci["low"] is None else (math.exp(ci["low"]), math.exp(ci["high"]))
    return {"mean": math.exp(ci["mean"]), "low": low, "high": high, "n": ci["n"]}


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (95% by default) for ``successes`` out of ``n`` trials.

    Unlike the normal interval it stays inside [0, 1] and is not empty at 0/n or n/n (Wilson, 1927)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson: need 0 <= successes ({successes}) <= n ({n}) and n >= 1")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def median_iqr(values: list[float]) -> dict:
    """Median and interquartile range (first and third quartiles, inclusive method) of timings."""
    if not values:
        raise ValueError("median_iqr: no values")
    if len(values) == 1:
        return {"median": values[0], "q1": values[0], "q3": values[0]}
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "q1": q1, "q3": q3}


def interval_fields(name: str, low: float | None, high: float | None) -> dict:
    """The scalar fields a record keeps for an interval: ``<name>_ci_low`` and ``<name>_ci_high``."""
    return {f"{name}_ci_low": low, f"{name}_ci_high": high}


def compare(name_a: str, a: tuple, name_b: str, b: tuple, metric: str = "value", lower_is_better=True) -> str:
    """One sentence comparing two measurements given as ``(value, low, high)``.

    Overlapping 95% intervals (or a missing interval) are "not distinguishable": the difference may be
    noise. Otherwise it says which one is better and by how much."""
    (va, la, ha), (vb, lb, hb) = a, b
    if None in (la, ha, lb, hb):
        return f"{name_a} and {name_b} are not distinguishable on {metric}: an interval is missing"
    if la <= hb and lb <= ha:
        return (
            f"{name_a} ({va:.4g} [{la:.4g}, {ha:.4g}]) and {name_b} ({vb:.4g} [{lb:.4g}, {hb:.4g}]) are "
            f"not distinguishable on {metric}: their 95% intervals overlap"
        )
    a_better = (va < vb) == lower_is_better
    (wn, wv), (ln, lv) = ((name_a, va), (name_b, vb)) if a_better else ((name_b, vb), (name_a, va))
    word = "lower" if (wv < lv) else "higher"
    return f"{wn} is better than {ln} on {metric}: {wv:.4g} vs {lv:.4g} ({word}; 95% intervals disjoint)"


def compare_paired(name_a: str, a: list[float], name_b: str, b: list[float], metric: str = "value",
                   lower_is_better: bool = True, unit: str = "slices") -> str:  # fmt: skip
    """One sentence comparing two configs measured on the same samples (the same text slices), by the
    95% t-interval of the per-sample differences ``a - b``: "not distinguishable" when it contains 0.

    Pairing removes the spread between texts (one essay is harder than another for every policy), which
    dominates an unpaired interval; use it whenever both runs scored the same slices."""
    if len(a) != len(b) or not a:
        raise ValueError(f"compare_paired: need the same number of samples ({len(a)} vs {len(b)})")
    ci = t_interval([x - y for x, y in zip(a, b, strict=True)])
    mean, low, high, n = ci["mean"], ci["low"], ci["high"], ci["n"]
    if low is None or low <= 0 <= high:
        span = "one pair, no interval" if low is None else f"[{low:.4g}, {high:.4g}], which includes 0"
        return (
            f"{name_a} and {name_b} are not distinguishable on {metric}: paired over {n} {unit}, "
            f"{name_a} - {name_b} = {mean:.4g} {span}"
        )
    a_better = (mean < 0) == lower_is_better
    winner, loser = (name_a, name_b) if a_better else (name_b, name_a)
    return (
        f"{winner} is better than {loser} on {metric}: paired over {n} {unit}, {name_a} - {name_b} = "
        f"{mean:.4g} [{low:.4g}, {high:.4g}] (95%)"
    )
