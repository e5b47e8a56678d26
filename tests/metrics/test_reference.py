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


@pytest.mark.parametrize("prefix, chunk", [(None, 1), (None, 7), (100, 1), (100, 5)])
def test_full_streamed_by_decode_perplexity_reads_exactly_one(prefix, chunk):
    """Decode-mode perplexity feeds ``full`` a prefix then ``chunk``-token forwards past 128 tokens (where
    buffers grow with headroom): its ratio against the reference fed the same way is exactly 1, where one
    prefill of the same tokens read about 1.002 before."""
    from kvcompress.metrics import decode_perplexity

    model = make_family("llama")
    ids = torch.randint(2, 90, (1, 301), generator=torch.Generator().manual_seed(0))
    got = decode_perplexity(model, ids, build_cache("full", model), chunk_size=chunk, prefix_tokens=prefix)
    assert got["cache_ratio"] == 1.0 and got["full_cache_bytes"] == got["cache_bytes"]
    if chunk > 1:  # chunked steps grow buffers with headroom that one forward of the same tokens never has
        assert full_cache_bytes(model, 300) < got["cache_bytes"]
