"""Retention of a span (a needle's answer) per layer and KV head, on kept sets with a known answer."""

from __future__ import annotations

import pytest
import torch

from kvcompress import build_cache
from kvcompress.metrics.retention import ReadSets, span_found, span_hits, summarize

SPAN = [10, 11, 12, 13]


def kept() -> list[torch.Tensor]:
    """Two layers of three KV heads: (1, h, k) kept positions."""
    layer0 = torch.tensor(
        [[
            [0, 10, 11, 12, 13, 20],  # head 0: the whole span
            [0, 11, 12, 30, 31, 32],  # head 1: two of four
            [0, 1, 2, 3, -1, -1],  # head 2: none (-1: unused slots)
        ]]
    )  # fmt: skip
    layer1 = torch.tensor([[[13, 12, 11, 10, 5, 5]]])  # one set for every head, unsorted, repeats
    return [layer0, layer1]


def test_hits_count_the_span_per_layer_and_head():
    assert span_hits(kept(), SPAN, 3).tolist() == [[4, 2, 0], [4, 4, 4]]
    found = span_found(kept(), SPAN, 3)
    assert found.shape == (2, 3, 4) and found[0, 1].tolist() == [False, True, True, False]


def test_summary_of_a_constructed_sample():
    got = summarize(span_hits(kept(), SPAN, 3), len(SPAN))
    assert got["share"] == pytest.approx((4 + 2 + 0 + 12) / (6 * 4))
    assert got["whole_rate"] == pytest.approx(4 / 6)  # (layer, head) pairs holding every answer token
    assert got["whole_everywhere"] == 0.0  # layer 0 head 2 lost it: not kept in every layer and head
    assert got["pairs_partial"] == pytest.approx(1 / 6) and got["pairs_none"] == pytest.approx(1 / 6)
    whole = summarize(span_hits([kept()[1]], SPAN, 3), len(SPAN))
    assert whole == {"share": 1.0, "whole_rate": 1.0, "whole_everywhere": 1.0, "pairs_partial": 0.0,
                     "pairs_none": 0.0}  # fmt: skip


def test_bad_shapes_and_empty_spans_are_refused():
    with pytest.raises(ValueError, match=r"\(1, 1 or 3, k\)"):
        span_hits([torch.zeros(2, 3, 4, dtype=torch.long)], SPAN, 3)
    with pytest.raises(ValueError, match="at least one token"):
        summarize(torch.zeros(2, 3), 0)


def test_read_sets_follow_what_attention_read(llama, tokens):
    n = tokens.shape[1]
    cache = build_cache("snapkv", llama, budget=20, observation_window=4)
    reads = ReadSets(cache)
    with torch.no_grad():
        llama(tokens, cache=cache)
        prefill = reads.snapshot()  # the prefill read every token, eviction came after
        llama(tokens[:, :1], cache=cache)
    assert all(set(p[0, h].tolist()) == set(range(n)) for p in prefill for h in range(p.shape[1]))
    for layer, held in zip(cache.layers, reads.snapshot(), strict=True):
        stored = layer.positions().expand(1, held.shape[1], -1)  # what it holds: decode step included
        assert torch.equal(held.sort(-1).values, stored.long().sort(-1).values) and held.shape[-1] == 21
