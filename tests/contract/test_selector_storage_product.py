"""Every selector over every storage (the product of conf/policy selectors and conf/storage variants):
each cell either keeps the cache contract or is refused by ``build_cache`` with an error naming why."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from conftest import (
    CELLS,
    IDS,
    SELECTORS,
    STORAGE_VARIANTS,
    build_or_refused,
    cell_policy,
    make_tiny,
    max_memory_ratio,
)
from helpers import held_tensors, refuses_padding, stream_logits

from kvcompress import build_cache
from kvcompress.core.buffers import storage_bytes


def test_refused_cells_are_exactly_the_declared_ones(capsys):
    """Every cell is built or refused as its classes declare (``build_or_refused``), and every storage
    serves some selector."""
    model = make_tiny("llama")
    refused = {(s, v) for s, v in CELLS if build_or_refused(s, v, model) is None}
    assert refused and refused != set(CELLS)  # both kinds of cell exist, over every storage below
    assert all(any((s, v) not in refused for s in SELECTORS) for v in STORAGE_VARIANTS)
    with capsys.disabled():
        print("\nrefused selector x storage cells:", sorted(refused))


@pytest.mark.parametrize("sel,var", CELLS, ids=IDS)
def test_cell_shapes_seq_length_and_bytes(sel, var, tiny_model, tokens):
    cache = build_or_refused(sel, var, tiny_model)
    if cache is None:
        return
    seen = []
    for layer in cache.layers:
        orig = layer.update

        def spy(k, v, *a, _orig=orig, **kw):
            out = _orig(k, v, *a, **kw)
            seen.append((k, *out))
            return out

        layer.update = spy
    stream_logits(tiny_model, tokens, cache, chunk=7)
    for new, keys, values in seen:  # (B, H_kv, T, D) in the model's dtype
        assert keys.dtype == values.dtype == new.dtype and keys.shape[:2] == new.shape[:2]
        assert keys.shape[-2] >= new.shape[-2] and keys.shape == values.shape
    assert cache.get_seq_length() == tokens.shape[1]
    assert all(layer.get_seq_length() == tokens.shape[1] for layer in cache.layers)
    held = [t for layer in cache.layers for t in held_tensors(layer)]
    assert cache.memory_bytes() == storage_bytes(held) > 0  # every byte held is counted
    full = build_cache("full", tiny_model)
    stream_logits(tiny_model, tokens, full, chunk=7)
    fixed = storage_bytes(t for layer in cache.layers for t in layer.store.fixed_tensors())
    assert cache.memory_bytes() - fixed <= full.memory_bytes() * max_memory_ratio(cell_policy(sel, var))


TOKENS = torch.randint(2, 95, (1, 48), generator=torch.Generator().manual_seed(1))  # conftest's ``tokens``
# Tokens per forward of a covering stream: prefill, chunked prefill and decode steps in one stream; Qwen2's
# starts token by token and prefills chunks after decode steps.
SCHEDULES = {"llama": [20, 9, 9] + [1] * 10, "qwen2": [1, 1, 1, 20, 1, 1, 1, 15] + [1] * 7}


@functools.cache
def plain_logits(family: str) -> torch.Tensor:
    """Logits (1, 48, V) of ``TOKENS``: one forward without a cache, on a model kvcompress never touched."""
    with torch.inference_mode():
        return make_tiny(family)(TOKENS, use_cache=False).logits


@torch.inference_mode()
def stream_sizes(model, ids, cache, sizes: list[int]) -> torch.Tensor:
    """Logits (B, N, V) of ``ids`` fed ``sizes[i]`` tokens at the i-th forward through ``cache``."""
    bounds = [0, *itertools.accumulate(sizes)]
    assert bounds[-1] == ids.shape[1]
    return torch.cat(
        [model(ids[:, s:e], cache=cache, use_cache=True).logits for s, e in itertools.pairwise(bounds)], 1
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("sel,var", CELLS, ids=IDS)
def test_cell_at_covering_budget_is_full(sel, var, family):
    """At a budget covering the whole sequence (``covering``) a cell is ``full``: nothing evicted, and the
    logits of a stream of prefill, chunked prefill and decode steps equal those of ``build_cache("full")``
    (itself checked against a forward without any cache) at float tolerance. Refused cells are skipped by
    their declared refusal only (``build_or_refused``)."""
    model = make_tiny(family)
    if build_or_refused(sel, var, model) is None:
        return
    ref = stream_logits(model, TOKENS, build_cache("full", model), chunk=TOKENS.shape[1])
    torch.testing.assert_close(ref, plain_logits(family), atol=1e-5, rtol=1e-5)
    cache = build_cache(cell_policy(sel, var).covering(TOKENS.shape[1]), model)
    got = stream_sizes(model, TOKENS, cache, SCHEDULES[family])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert all(s["tokens_evicted"] == 0 and s["tokens_stored"] == TOKENS.shape[1] for s in cache.stats())


def _generate(model, ids, mask, policy):
    cache = build_cache(policy, model)
    out = model.generate(
        input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0
    )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("sel,var", CELLS, ids=IDS)
def test_cell_left_padded_batch_matches_rows_alone(sel, var):
    model = make_tiny("llama")
    if build_or_refused(sel, var, model) is None:
        return
    policy = cell_policy(sel, var)
    if refuses_padding(build_cache(policy, model), policy.name):  # declared: pads_exactly = False
        return
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(2, 95, (1, 30), generator=g), torch.randint(2, 95, (1, 22), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    batched = _generate(model, ids, mask, policy)
    for row, alone in ((0, long), (1, short)):  # a row that ended (eos) alone is padded in the batch
        expect = _generate(model, alone, None, policy)[0]
        assert torch.equal(batched[row, : len(expect)], expect) and not batched[row, len(expect) :].any()


@functools.cache
def bf16_model():
    return make_tiny("llama", dtype=torch.bfloat16)


_BF16_FULL: dict = {}


@torch.inference_mode()
def bf16_full_bytes(tokens: torch.Tensor) -> int:
    """``full``'s bytes after the same stream (``tokens`` in chunks of 7, then 4 decode steps), once."""
    key = tuple(tokens.flatten().tolist())
    if key not in _BF16_FULL:
        model, full = bf16_model(), build_cache("full", bf16_model())
        stream_logits(model, tokens, full, chunk=7)
        for t in range(4):
            model(torch.tensor([[3 + t]]), cache=full, use_cache=True)
        _BF16_FULL[key] = full.memory_bytes()
    return _BF16_FULL[key]


@pytest.mark.parametrize("sel,var", CELLS, ids=IDS)
@torch.inference_mode()
def test_cell_runs_in_bfloat16(sel, var, tokens):
    """bf16 end to end: the cell runs a bfloat16 model (prefill in chunks, then decode steps), hands
    attention bfloat16 keys and values, gives finite logits, and holds no more than its allowance over
    ``full``'s bytes in bfloat16; or it is refused as declared."""
    model = bf16_model()
    cache = build_or_refused(sel, var, model)
    if cache is None:
        return
    dtypes = set()
    for layer in cache.layers:
        orig = layer.update

        def spy(k, v, *a, _orig=orig, **kw):
            out = _orig(k, v, *a, **kw)
            dtypes.update({out[0].dtype, out[1].dtype})
            return out

        layer.update = spy
    logits = stream_logits(model, tokens, cache, chunk=7)
    for t in range(4):
        logits = model(torch.tensor([[3 + t]]), cache=cache, use_cache=True).logits
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert dtypes == {torch.bfloat16}
    fixed = storage_bytes(t for layer in cache.layers for t in layer.store.fixed_tensors())
    assert cache.memory_bytes() - fixed <= bf16_full_bytes(tokens) * max_memory_ratio(cell_policy(sel, var))
