"""``policy=`` is a field of wrapper policies (``pyramidkv``'s inner selector), never a clash with
``build_cache``'s own first argument: a wrapper takes it, any other policy refuses it by name."""

from __future__ import annotations

import pytest

from kvcompress import build_cache
from kvcompress.core.cache import make_policy


def test_a_wrapper_takes_policy_as_a_field(llama):
    inner = {"_target_": "kvcompress.selectors.TOVAPolicy"}
    cache = build_cache("pyramidkv", llama, policy=inner, compression_ratio=0.5)
    assert cache.policy.policy == inner and make_policy("pyramidkv", policy=inner).policy == inner


@pytest.mark.parametrize("name", ["snapkv", "mixed_precision", "window_schedule", "full"])
def test_a_policy_without_that_field_refuses_it_by_name(llama, name):
    with pytest.raises(ValueError, match=rf"policy '{name}' has no field\(s\) \['policy'\]; fields: \["):
        build_cache(name, llama, policy="snapkv")
