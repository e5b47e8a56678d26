"""Block eviction's ``evict_at`` (always: H2O's, the default; prefill: decode tokens appended) and its refused
``threshold``, on the tiny Llama."""

from __future__ import annotations

import pytest
import torch

from kvcompress import build_cache, make_policy
from kvcompress.core.policy import Shape

FIELDS = {"block_size": 4, "budget": 16, "compression_ratio": None, "sink_tokens": 2, "recent": 4,
          "observation_window": 4}  # fmt: skip
G = torch.Generator().manual_seed(7)
IDS = torch.randint(2, 95, (1, 48), generator=G)
STEPS = torch.randint(2, 95, (1, 9), generator=G)


@torch.inference_mode()
def _run(model, cache, decode: int) -> list[tuple[int, int]]:
    """(stored, evicted) of layer 0 after the prompt and after each of ``decode`` one-token steps; every layer
    must agree on the stored length."""
    out = []
    for ids in [IDS] + [STEPS[:, i : i + 1] for i in range(decode)]:
        model(ids, cache=cache)
        assert len({layer.stored_length() for layer in cache.layers}) == 1
        out.append((cache.layers[0].stored_length(), cache.layers[0].evicted))
    return out


def test_the_default_is_h2os_always_as_before(llama):
    policy = make_policy("block_evict")
    assert policy.evict_at == policy.evicts == "always" and policy.threshold is None
    default = build_cache("block_evict", llama, **FIELDS)
    always = build_cache("block_evict", llama, **FIELDS, evict_at="always")
    assert _run(llama, default, 9) == _run(llama, always, 9)
    assert all(s["evict_at"] == "always" for s in default.stats())


def test_prefill_appends_decode_tokens_and_always_keeps_the_target(llama):
    """prefill: the prompt is cut to whole blocks under the target once, then every decode token is stored
    (one more per step, nothing evicted); always: a decode step over the target evicts a whole block."""
    prefill = _run(llama, build_cache("block_evict", llama, **FIELDS, evict_at="prefill"), 9)
    always = _run(llama, build_cache("block_evict", llama, **FIELDS, evict_at="always"), 9)
    assert prefill[0] == always[0] and prefill[0][0] <= 16
    first, evicted = prefill[0]
    assert prefill == [(first + i, evicted) for i in range(10)]
    for (before, _), (after, _) in zip(always, always[1:], strict=False):
        assert after <= 16 and after - before in (1, 1 - 4)  # one token in, at most one block of 4 out
    assert always[-1][1] > evicted  # decode steps did evict


@pytest.mark.parametrize("evict_at", ["prefill", "always"])
def test_memory_formula_follows_evict_at(evict_at, llama):
    policy = make_policy("block_evict", **FIELDS, evict_at=evict_at)
    got = _run(llama, build_cache(policy, llama), 9)
    assert [policy.kept_tokens(Shape(1, 2, 4, 16, 4, 48, d)) for d in range(10)] == [s for s, _ in got]


def test_prefill_evicts_again_at_a_later_step_of_several_tokens(llama):
    cache = build_cache("block_evict", llama, **FIELDS, evict_at="prefill")
    _run(llama, cache, 9)
    assert cache.layers[0].stored_length() > 16
    with torch.inference_mode():
        llama(torch.randint(2, 95, (1, 6), generator=G), cache=cache)
    assert all(layer.stored_length() <= 16 for layer in cache.layers)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"threshold": 0.1}, r"block_evict.threshold=0.1 is not served: a threshold keeps a different number "
         r"of blocks in each KV head, and block_evict's layout holds the same number in every head of a row.*"
         r"allowed: \[None\]"),
        ({"evict_at": "sometimes"}, r"block_evict.evict_at='sometimes' is not supported; allowed: "
         r"\['prefill', 'always'\]"),
    ],
)  # fmt: skip
def test_what_block_evict_cannot_serve_is_refused_by_name(fields, match, llama):
    with pytest.raises(ValueError, match=match):
        build_cache("block_evict", llama, **fields)
