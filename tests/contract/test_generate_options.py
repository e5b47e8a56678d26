"""generate() options that need more of a cache than appending: ``crop`` (assisted and prompt-lookup
decoding) and beam search. Every registered policy either does exactly what the model's own cache does, or
refuses by name."""

from __future__ import annotations

import pytest
import torch
from conftest import POLICY_NAMES, small
from transformers import DynamicCache

from kvcompress import build_cache, make_policy
from kvcompress.core.cache import KVCache

G = torch.Generator().manual_seed(11)
PROMPT = torch.randint(2, 95, (1, 40), generator=G)
LOOKUP = torch.cat([PROMPT[:, :20], PROMPT[:, :20]], 1)  # repeated n-grams: prompt lookup proposes drafts
CANDIDATES = torch.randint(2, 95, (1, 4), generator=G)
NEXT = torch.randint(2, 95, (1, 3), generator=G)

# policies that must roll back at their small test parameters after this prompt (the rest may refuse)
CROPS = {"full", "kvzip"}
# covering, they still move tokens at some verification steps (pages sent cold), which crop refuses
REFUSE_WHEN_COVERING = {"tiered"}


def _covering(name: str, tokens: int):
    return small(name).covering(tokens)


@torch.inference_mode()
def _continue(model, cache, steps) -> torch.Tensor:
    return torch.cat([model(steps[:, i : i + 1], cache=cache).logits for i in range(steps.shape[1])], 1)


@torch.inference_mode()
def _crop_or_refuse(model, policy, prompt, name: str) -> str | None:
    """Prompt, four candidates in one forward, crop the last three. Returns the refusal (which must name the
    policy and leave the cache as it was), or None after checking that the next steps' logits equal those
    of a cache that only ever got the one accepted token."""
    reference = build_cache(policy, model)
    model(prompt, cache=reference)
    want = _continue(model, reference, torch.cat([CANDIDATES[:, :1], NEXT], 1))[:, 1:]
    cache = build_cache(policy, model)
    model(prompt, cache=cache)
    model(CANDIDATES, cache=cache)
    try:
        cache.crop(-3)
    except ValueError as err:
        assert f"policy {name!r} cannot roll back" in str(err)
        assert cache.get_seq_length() == prompt.shape[1] + 4  # no layer cropped
        return str(err)
    assert cache.get_seq_length() == prompt.shape[1] + 1
    assert cache.memory_bytes() <= reference.memory_bytes() * 1.05 + 64  # the cut slots stay as headroom
    torch.testing.assert_close(_continue(model, cache, NEXT), want, atol=1e-5, rtol=1e-5)
    return None


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_crop_leaves_the_cache_as_if_the_rejected_tokens_never_came(name, llama):
    policy = small(name)
    refusal = _crop_or_refuse(llama, policy, PROMPT, policy.name)
    assert refusal is None or name not in CROPS


def test_quant_crops_tokens_still_in_the_window_and_refuses_a_group_they_pushed_out(llama):
    """int4, an 8-token window: with 8-token groups the candidates stay in the window (40 + 4 tokens: no
    group leaves it) and crop is exact; with 4-token groups their step quantized a group that would still
    be exact without them, and crop refuses, naming why."""
    exact = make_policy("quant", bits=4, group_size=8, recent=8)
    assert _crop_or_refuse(llama, exact, PROMPT, "quant") is None
    pushed = make_policy("quant", bits=4, group_size=4, recent=8)
    assert "encoded region" in _crop_or_refuse(llama, pushed, PROMPT, "quant")


def test_tiered_crops_the_hot_tail_and_refuses_a_page_the_candidates_sent_cold(llama):
    """8-token pages, a 32-token recent window: after 40 tokens the candidates send no page cold (crop is
    exact); after 44 they send one, and crop refuses."""
    assert _crop_or_refuse(llama, make_policy("tiered"), PROMPT, "tiered") is None
    longer = torch.cat([PROMPT, PROMPT[:, :4]], 1)
    assert "cold tier" in _crop_or_refuse(llama, make_policy("tiered"), longer, "tiered")


def _counting_crops(monkeypatch) -> list[int]:
    removed = []
    crop = KVCache.crop

    def counted(self, n):
        removed.append(-n)
        return crop(self, n)

    monkeypatch.setattr(KVCache, "crop", counted)
    return removed


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_prompt_lookup_decoding_matches_the_models_own_cache(name, llama, monkeypatch):
    """With a budget that covers the sequence, prompt-lookup decoding (drafts rejected and cropped) gives
    the tokens it gives over ``DynamicCache``; a policy that can never roll back says so by name."""
    kw = dict(max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3, pad_token_id=0)
    want = llama.generate(LOOKUP, cache=DynamicCache(config=llama.config), **kw)
    removed = _counting_crops(monkeypatch)
    cache = build_cache(_covering(name, 64), llama)
    try:
        got = llama.generate(LOOKUP, cache=cache, **kw)
    except ValueError as err:
        assert f"policy {cache.policy.name!r} cannot roll back" in str(err)
        assert any(layer.never_crops() for layer in cache.layers) or name in REFUSE_WHEN_COVERING
        return
    assert torch.equal(got, want)
    assert sum(removed) > 0  # some drafts were rejected: crop really ran


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_beam_search_matches_the_models_own_cache(name, llama):
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2, pad_token_id=0)
    want = llama.generate(PROMPT, cache=DynamicCache(config=llama.config), **kw)
    got = llama.generate(PROMPT, cache=build_cache(_covering(name, 64), llama), **kw)
    assert torch.equal(got, want)
