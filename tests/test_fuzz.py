"""Property-based fuzzing of every policy: random shapes, lengths, padding, chunk sizes and parameters.

CI runs a bounded number of examples; ``HYPOTHESIS_PROFILE=long`` runs many more locally.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import POLICY_NAMES, SMALL, make_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompress import build_cache, make_policy

settings.register_profile("ci", max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Per-policy parameter strategies; a policy without one is fuzzed with its SMALL overrides.
PARAMS = {
    "sliding_window": st.fixed_dictionaries({"sink_tokens": st.integers(0, 6), "window": st.integers(1, 24)}),
}

MODEL = make_tiny("llama")
COMPRESSING = {"full": False}


def _params(name):
    return PARAMS.get(name, st.just(SMALL.get(name, {})))


@st.composite
def cases(draw, name):
    batch = draw(st.integers(1, 2))
    length = draw(st.integers(2, 56))
    pads = [0] + [draw(st.integers(0, length - 1)) for _ in range(batch - 1)]
    return {
        "params": draw(_params(name)),
        "chunk": draw(st.integers(1, 17)),
        "ids": torch.randint(
            2, 95, (batch, length), generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))
        ),
        "pads": pads,
    }


def _stream(cache, ids, mask, chunk):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        for s in range(0, ids.shape[1], chunk):
            e = s + chunk
            out = MODEL(ids[:, s:e], attention_mask=mask[:, :e], position_ids=positions[:, s:e], cache=cache)
            assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_fuzz_policy(name):
    @given(case=cases(name))
    def check(case):
        ids, chunk = case["ids"], case["chunk"]
        mask = torch.ones_like(ids)
        for row, pad in enumerate(case["pads"]):
            mask[row, :pad] = 0
        try:
            policy = make_policy(name, **case["params"])
            cache = build_cache(policy, MODEL)
        except ValueError:
            return  # invalid parameter combinations must fail at construction, clearly
        full = build_cache("full", MODEL)
        _stream(cache, ids, mask, chunk)
        _stream(full, ids, mask, chunk)
        assert cache.get_seq_length() == ids.shape[1]
        assert all(s["tokens_seen"] == ids.shape[1] for s in cache.stats())
        if COMPRESSING.get(name, True):
            assert cache.memory_bytes() <= full.memory_bytes() * 1.05

    check()
