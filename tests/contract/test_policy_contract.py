"""One contract for every policy in conf/policy/ (a new policy is picked up by itself); the selector x
storage product is in ``test_selector_storage_product.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import POLICY_NAMES, make_tiny, max_memory_ratio, small
from helpers import held_tensors, refuses_padding, stream_logits
from transformers import DynamicCache

from kvcompress import build_cache
from kvcompress.core.attention import set_backend
from kvcompress.core.buffers import storage_bytes


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_update_returns_model_shapes_and_dtype(name, tiny_model, tokens):
    cache = build_cache(small(name), tiny_model)
    seen = []
    for layer in cache.layers:
        orig = layer.update

        def spy(k, v, *a, _orig=orig, **kw):
            keys, values = _orig(k, v, *a, **kw)
            seen.append((k, keys, values))
            return keys, values

        layer.update = spy
    stream_logits(tiny_model, tokens, cache, chunk=16)
    for new, keys, values in seen:
        assert keys.dtype == values.dtype == new.dtype
        assert keys.shape[:2] == new.shape[:2] and keys.shape[-1] == new.shape[-1]  # (B, H_kv, T, D)
        assert keys.shape[-2] >= new.shape[-2]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_seq_length_is_absolute_position(name, tiny_model, tokens):
    cache = build_cache(small(name), tiny_model)
    stream_logits(tiny_model, tokens[:, :30], cache, chunk=7)
    assert cache.get_seq_length() == 30
    assert all(layer.get_seq_length() == 30 for layer in cache.layers)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_chunked_prefill_same_under_sdpa_and_eager(name, tokens):
    logits = {}
    for backend in ("sdpa", "eager"):
        model = make_tiny("llama")
        set_backend(model, backend)
        logits[backend] = stream_logits(model, tokens, build_cache(small(name), model), chunk=10)
    torch.testing.assert_close(logits["sdpa"], logits["eager"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 9, 48])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_covering_budget_reproduces_dynamic_cache(name, chunk, tiny_model, tokens):
    ref = stream_logits(tiny_model, tokens, DynamicCache(config=tiny_model.config), chunk=chunk)
    policy = small(name).covering(tokens.shape[1])
    got = stream_logits(tiny_model, tokens, build_cache(policy, tiny_model), chunk=chunk)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_memory_bytes_counts_every_tensor_held(name, tiny_model, tokens):
    cache = build_cache(small(name), tiny_model)
    stream_logits(tiny_model, tokens, cache, chunk=5)
    held = [t for layer in cache.layers for t in held_tensors(layer)]
    assert cache.memory_bytes() == storage_bytes(held) > 0
    full = build_cache("full", tiny_model)
    stream_logits(tiny_model, tokens, full, chunk=5)
    assert cache.memory_bytes() <= full.memory_bytes() * max_memory_ratio(small(name))


def _generate(model, ids, mask, name):
    cache = build_cache(small(name), model)
    out = model.generate(
        input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0
    )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_left_padded_batch_matches_unpadded_rows(name, tiny_model):
    """The padded batch runs and each row generates what it generates alone, or the policy declares that it
    cannot (``pads_exactly = False``) and a padded batch is refused by name; any other error fails."""
    if refuses_padding(build_cache(small(name), tiny_model), name):
        return
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(2, 95, (1, 30), generator=g), torch.randint(2, 95, (1, 22), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    batched = _generate(tiny_model, ids, mask, name)
    assert torch.equal(batched[0], _generate(tiny_model, long, None, name)[0])
    assert torch.equal(batched[1], _generate(tiny_model, short, None, name)[0])


@pytest.mark.parametrize("name", POLICY_NAMES)
@torch.inference_mode()
def test_reorder_cache_moves_every_rows_state_with_its_row(name, tiny_model):
    """Beam search's reorder: after ``reorder_cache([1, 1])`` both rows continue as row 1 did, exactly as a
    cache that held row 1 twice from the start (tokens, positions, scores, pages, codes: every per-row
    state is moved by one reorder, ``core.storage.take_rows``)."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(2, 95, (2, 48), generator=g)
    twice = rows[[1, 1]]
    moved, reference = build_cache(small(name), tiny_model), build_cache(small(name), tiny_model)
    stream_logits(tiny_model, rows, moved, chunk=12)
    stream_logits(tiny_model, twice, reference, chunk=12)
    moved.reorder_cache(torch.tensor([1, 1]))
    for a, b in zip(
        moved.layers, reference.layers, strict=True
    ):  # every declared per-row state, and the store
        for field in ("valid", "pos", "left_pad", *a.per_token, *a.per_row):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None) == (y is None), field
            if x is not None:
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6, msg=f"{name}: {field}")
        for x, y in zip(a.store.tensors(), b.store.tensors(), strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    for t in range(8):  # decode steps: later evictions read the moved scores and pages too
        step = torch.full((2, 1), 7 + 3 * t)
        got = tiny_model(step, cache=moved, use_cache=True).logits
        want = tiny_model(step, cache=reference, use_cache=True).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert moved.get_seq_length() == reference.get_seq_length() == 56
