"""Property-based fuzzing of every policy: random shapes, lengths, padding, chunk sizes and parameters.

CI runs a bounded number of examples; ``HYPOTHESIS_PROFILE=long`` runs many more locally.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import MAX_MEMORY_RATIO, POLICY_NAMES, SMALL, make_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompress import build_cache, make_policy
from kvcompress.policies.base import storage_bytes

settings.register_profile("ci", max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Per-policy parameter strategies; a policy without one is fuzzed with its SMALL overrides.
_budget = st.one_of(
    st.fixed_dictionaries({"budget": st.integers(1, 40), "compression_ratio": st.none()}),
    st.fixed_dictionaries({"budget": st.none(), "compression_ratio": st.floats(0.0, 0.95)}),
)


def _with_budget(**extra):
    return st.tuples(_budget, st.fixed_dictionaries(extra)).map(lambda t: {**t[0], **t[1]})


PARAMS = {
    "sliding_window": st.fixed_dictionaries({"sink_tokens": st.integers(0, 6), "window": st.integers(1, 24)}),
    "quant": st.fixed_dictionaries(
        {
            "bits": st.sampled_from([2, 4, 8]),
            "group_size": st.sampled_from([2, 4, 8, 16]),
            "residual_length": st.integers(0, 20),
            "key_axis": st.sampled_from(["channel", "token"]),
            "value_axis": st.sampled_from(["channel", "token"]),
        }
    ),
    "h2o": _with_budget(recent=st.one_of(st.none(), st.integers(0, 10)), window=st.integers(1, 8)),
    "tova": _with_budget(),
    # slack=None: with slack SnapKV also holds its last `window` queries (counted in memory_bytes), which
    # on sequences shorter than about budget + 1.5 x window is more than the full cache holds.
    "snapkv": _with_budget(window=st.integers(1, 8), kernel_size=st.sampled_from([1, 3, 5]), slack=st.none()),
    "pyramidkv": _with_budget(beta=st.integers(1, 30)),
    "block_sparse": st.fixed_dictionaries(
        {"block_size": st.integers(1, 8), "top_k_blocks": st.integers(1, 6)}
    ),
    "block_evict": st.fixed_dictionaries(
        {
            "block_size": st.integers(1, 8),
            "sink_tokens": st.integers(0, 6),
            "recent": st.integers(0, 10),
            "window": st.integers(1, 8),
        }
    ).flatmap(
        lambda p: st.one_of(
            st.fixed_dictionaries({"budget": st.integers(1, 60), "keep_ratio": st.none()}),
            st.fixed_dictionaries({"budget": st.none(), "keep_ratio": st.floats(0.05, 1.0)}),
        ).map(lambda b: {**p, **b})
    ),
    "low_rank": st.fixed_dictionaries(
        {
            "rank": st.integers(1, 16),
            "residual_length": st.integers(0, 12),
            "calibration_text": st.just("random"),
            "calibration_tokens": st.just(64),
        }
    ),
}

MODEL = make_tiny("llama")


def FIXED_STATE(layer):  # noqa: N802 - tensors whose size does not depend on the sequence
    return [getattr(layer, n) for n in ("key_basis", "value_basis") if getattr(layer, n, None) is not None]


COMPRESSING = {"full": False, "block_sparse": False}  # Quest reads less but stores everything


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
        if COMPRESSING.get(name, True):  # fixed per-layer state (low_rank's bases) is not per-token growth
            fixed = storage_bytes(t for layer in cache.layers for t in FIXED_STATE(layer))
            assert cache.memory_bytes() - fixed <= full.memory_bytes() * MAX_MEMORY_RATIO.get(name, 1.05)

    check()
