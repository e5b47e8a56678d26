"""The reference of ``cache_ratio``: ``full`` fed as the measured cache was, so ``full`` is 1.0 against it."""

import pytest
import torch
from zoo import make_family

from kvcompress import build_cache
from kvcompress.metrics.reference import full_cache_bytes


def _fed(model, prefill: int, steps: int):
    """A ``full`` cache after a forward of ``prefill`` tokens and ``steps`` one-token forwards."""
    cache = build_cache("full", model)
    with torch.inference_mode():
        model(torch.zeros(1, prefill, dtype=torch.long), cache=cache, use_cache=True)
        for _ in range(steps):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("family, grows", [("llama", True), ("gemma3", True), ("mistral", False)])
def test_full_after_prefill_and_decode_steps_is_exactly_its_reference(family, grows):
    """Past 128 tokens a one-token step grows a full-attention layer's buffers with headroom: ``full`` then
    holds more than one prefill of the same tokens would (not where every layer keeps a 12-token window),
    and the reference with ``prefill=`` is exactly what it holds."""
    model = make_family(family)
    cache = _fed(model, 300, 7)
    assert cache.memory_bytes() == full_cache_bytes(model, 307, prefill=300)
    one_prefill = full_cache_bytes(model, 307)  # headroom: what one prefill never holds
    assert cache.memory_bytes() > one_prefill if grows else cache.memory_bytes() == one_prefill
    assert full_cache_bytes(model, 307, batch=2, prefill=300) == 2 * cache.memory_bytes()


def test_a_prefill_of_every_token_is_the_one_forward_reference():
    model = make_family("llama")
    assert full_cache_bytes(model, 40, prefill=40) == _fed(model, 40, 0).memory_bytes()


@pytest.mark.parametrize("prefill", [0, 41])
def test_a_prefill_outside_the_tokens_is_refused(prefill):
    with pytest.raises(ValueError, match=r"prefill=.* must be in \[1, tokens=40\]"):
        full_cache_bytes(make_family("llama"), 40, prefill=prefill)
