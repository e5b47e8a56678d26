"""Disjoint text slices for perplexity, and their combination into a mean with a 95% interval.

One 1k-token text cannot tell two policies apart by a few tenths of perplexity: the spread between
texts is larger. ``task.slices`` slices of ``task.max_tokens`` tokens start ``task.slice_stride`` tokens
apart (16384 by default: on the embedded essays, whose essays run a few thousand tokens each, every slice
falls in a different essay); the result is the perplexity of the slices together, ``exp`` of their mean
NLL, with a 95% interval computed on that log scale (a t-interval on the NLL, mapped back: it never crosses
zero), and each slice's own numbers stay in the record.
"""

from __future__ import annotations

from kvcompress.metrics.perplexity_interval import perplexity_fields

PER_SLICE = ("offset_tokens", "perplexity", "nll", "tokens_scored", "cache_bytes", "tokens_evicted")


def slice_starts(cfg) -> list[int]:
    """Token offsets of the slices: ``offset_tokens + k * slice_stride`` for ``k < slices``; disjoint."""
    slices, stride = int(cfg.get("slices", 1)), int(cfg.get("slice_stride", cfg.max_tokens))
    offset = int(cfg.get("offset_tokens", 0))
    if slices < 1:
        raise ValueError(f"task.slices={slices} must be >= 1")
    if slices > 1 and stride < cfg.max_tokens:
        raise ValueError(
            f"task.slice_stride={stride} must be >= task.max_tokens={cfg.max_tokens}: slices must not overlap"
        )
    return [offset + k * stride for k in range(slices)]


def slice_ids(tokenizer, text: str, starts: list[int], max_tokens: int, text_name: str = "text"):
    """Token ids (1, max_tokens) of each slice of ``text`` (tokenized once, whole)."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    need = starts[-1] + max_tokens
    if ids.shape[1] < need:
        raise ValueError(
            f"task.slices={len(starts)}: text {text_name!r} has {ids.shape[1]} tokens, {need} needed for the "
            f"last slice (offsets {starts}, task.max_tokens={max_tokens}); lower task.slices, "
            "task.slice_stride or task.max_tokens"
        )
    return [ids[:, s : s + max_tokens] for s in starts]


def combine_slices(per_slice: list[dict]) -> dict:
    """One metrics dict from the slices' own: perplexity and nll with 95% intervals (``perplexity_fields``),
    ``tokens_scored``, ``tokens_evicted`` and ``attention_backends`` summed, ``compressed`` only when every
    slice compressed, the cache fields of the first slice (equal lengths give equal bytes for all but
    score-dependent layouts), and ``slices``: each slice's offset, perplexity, nll, tokens and bytes."""
    first = per_slice[0]
    out = dict(first)
    out.pop("offset_tokens", None)
    out |= perplexity_fields(per_slice)
    out["tokens_scored"] = sum(s["tokens_scored"] for s in per_slice)
    if all("tokens_evicted" in s for s in per_slice):
        out["tokens_evicted"] = sum(s["tokens_evicted"] for s in per_slice)
    if all("attention_backends" in s for s in per_slice):  # layer-steps per backend, over every slice
        ran = [s["attention_backends"] for s in per_slice]
        out["attention_backends"] = {k: sum(r.get(k, 0) for r in ran) for k in sorted(set().union(*ran))}
    if all("compressed" in s for s in per_slice):
        out["compressed"] = all(s["compressed"] for s in per_slice)
        warnings = [s["warning"] for s in per_slice if s.get("warning")]
        out.pop("warning", None)
        if warnings:
            out["warning"] = warnings[0]
    out["slice_count"] = len(per_slice)
    out["slices"] = [{k: s.get(k) for k in PER_SLICE} for s in per_slice]
    return out
