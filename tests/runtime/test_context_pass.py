"""Feeding a prompt through a policy cache (``kvcompress.runtime.context_pass``): chunked prefill equals one
forward, the context pass of query-agnostic selectors (KVzip) runs exactly where a cache asks for it, at the
positions after each row's context, stores none of the reconstruction and leaves the prefill's cache when it
fails; its inputs quote the previous chunk; refusals named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny
from transformers import DynamicCache

from kvcompress import build_cache, compress_context
from kvcompress.runtime import context_pass
from kvcompress.runtime.context_pass import (
    OVERLAP,
    Prompts,
    after_prefill,
    forward_prompt,
    needs_context_pass,
    prefill,
    prefill_chunk,
    reconstruction_chunks,
)
from kvcompress.selectors import KVzipPolicy

KVZIP = KVzipPolicy.TEST_PARAMS  # budget 12, chunks of 16 context tokens, 2 sinks


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama")


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 95, (1, n), generator=torch.Generator().manual_seed(seed))


def _keys(cache) -> list[torch.Tensor]:
    return [layer.store.read()[0].clone() for layer in cache.layers]


def test_a_cache_needs_the_pass_when_one_of_its_layers_does(model):
    assert needs_context_pass(build_cache("kvzip", model, **KVZIP))
    assert not needs_context_pass(build_cache("snapkv", model))
    assert not needs_context_pass(build_cache("full", model))
    assert not needs_context_pass(DynamicCache(config=model.config)) and not needs_context_pass(object())


def test_refusals_name_the_problem(model):
    with pytest.raises(RuntimeError, match="needs a prefilled cache"):
        compress_context(model, build_cache("kvzip", model), _ids(8))
    assert compress_context(model, build_cache("snapkv", model), _ids(8)) == {"context_pass": False}


@torch.inference_mode()
def test_a_layers_refusal_is_raised_with_the_layer_and_leaves_the_cache(model):
    cache = build_cache("kvzip", model, **KVZIP, adaptive=True)
    prefill(model, cache, _ids(40))
    before = _keys(cache)
    with pytest.raises(ValueError, match="layer 0: kvzip.adaptive=true: a second context pass is not supp"):
        compress_context(model, cache, _ids(40))
    assert all(torch.equal(a, b) for a, b in zip(_keys(cache), before, strict=True))


def test_the_smallest_prefill_chunk_a_layer_asks_for():
    layers = [SimpleNamespace(prefill_chunk=16), SimpleNamespace(), SimpleNamespace(prefill_chunk=7)]
    assert prefill_chunk(SimpleNamespace(layers=layers)) == 7
    assert prefill_chunk(SimpleNamespace(layers=[SimpleNamespace(prefill_chunk=None)])) is None
    assert prefill_chunk(object()) is None


@pytest.mark.parametrize("padded", [False, True])
@torch.inference_mode()
def test_a_prefill_in_chunks_stores_what_one_forward_stores(model, padded):
    ids = torch.cat([_ids(20), _ids(20, seed=2)])
    kwargs = {}
    if padded:  # row 1 left-padded: positions count from its first real token in every chunk
        mask = torch.ones_like(ids)
        mask[1, :6] = 0
        kwargs = {"attention_mask": mask}
    whole = build_cache("full", model)
    positions = {} if not padded else {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    want = forward_prompt(model, whole, ids, **kwargs, **positions)
    chunked = build_cache("full", model)
    for layer in chunked.layers:
        layer.prefill_chunk = 7  # as a tiered layer asks
    calls = []
    hook = model.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[1]))
    try:
        got = forward_prompt(model, chunked, ids, **kwargs)
    finally:
        hook.remove()
    assert calls == [7, 7, 6] and got.logits.shape[1] == 6  # the last forward's output
    torch.testing.assert_close(got.logits, want.logits[:, -6:], atol=1e-5, rtol=1e-5)
    real = torch.ones_like(ids, dtype=torch.bool) if not padded else mask.bool()  # a padding slot's keys: any
    for a, b in zip(_keys(chunked), _keys(whole), strict=True):
        for row in range(2):
            torch.testing.assert_close(a[row][:, real[row]], b[row][:, real[row]], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_prefill_runs_the_pass_only_where_the_cache_needs_it_and_equals_doing_it_by_hand(model):
    ids = _ids(40)
    full = build_cache("full", model)
    uncompressed = prefill(model, full, ids).logits
    assert all(layer.stored_length() == 40 for layer in full.layers)  # no pass for full
    cache = build_cache("kvzip", model, **KVZIP)
    out = prefill(model, cache, ids)
    torch.testing.assert_close(out.logits, uncompressed, atol=1e-5, rtol=1e-5)  # the prompt saw every token
    assert all(layer.stored_length() == 12 and layer.context_passes == 1 for layer in cache.layers)
    by_hand = build_cache("kvzip", model, **KVZIP)
    model(ids, cache=by_hand)
    info = compress_context(model, by_hand, ids)
    assert info["context_pass"] is True and info["context_chunks"] == 3 and info["context_pass_s"] >= 0
    assert all(torch.equal(a, b) for a, b in zip(_keys(by_hand), _keys(cache), strict=True))
    more = _ids(3, seed=3)  # the compressed cache stays usable, as the prefill's did
    torch.testing.assert_close(model(more, cache=cache).logits, model(more, cache=by_hand).logits)
    assert cache.get_seq_length() == 43 and all(layer.stored_length() == 15 for layer in cache.layers)


@torch.inference_mode()
def test_the_pass_reconstructs_after_each_rows_context_and_stores_none_of_it(model, monkeypatch):
    ids = torch.cat([_ids(40), torch.cat([torch.zeros(1, 26, dtype=torch.long), _ids(14, seed=5)], 1)])
    mask = torch.ones_like(ids)
    mask[1, :26] = 0
    cache = build_cache("kvzip", model, **KVZIP)
    model(ids, cache=cache, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    layers, seen = list(cache.layers), []
    reconstruct = context_pass._reconstruct

    def spy(model, cache, ids, valid, first_position):
        seen.append((ids.shape, first_position.tolist(), cache.get_seq_length()))
        return reconstruct(model, cache, ids, valid, first_position)

    monkeypatch.setattr(context_pass, "_reconstruct", spy)
    assert compress_context(model, cache, ids, attention_mask=mask)["context_chunks"] == 3
    # 40 and 14 real tokens, 16 a chunk after the previous chunk's last 8 (no tokenizer: no instruction);
    # row 1 is done after its first chunk (then all padding)
    assert [tuple(shape) for shape, _, _ in seen] == [(2, 16), (2, 8 + 16), (2, 8 + 8)]
    assert all(first == [[40], [14]] and length == 40 for _, first, length in seen)  # nothing stored
    assert cache.layers == layers and all(type(layer).__name__ == "KVzipLayer" for layer in cache.layers)
    assert all(layer.get_seq_length() == 40 and layer.stored_length() == 12 for layer in cache.layers)


@torch.inference_mode()
def test_a_pass_that_fails_leaves_the_prefills_cache(model, monkeypatch):
    ids = _ids(40)
    cache = build_cache("kvzip", model, **KVZIP)
    model(ids, cache=cache)
    layers, before = list(cache.layers), _keys(cache)
    reconstruct, calls = context_pass._reconstruct, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # any interruption, not only an Exception
        return reconstruct(*args)

    monkeypatch.setattr(context_pass, "_reconstruct", failing)
    with pytest.raises(KeyboardInterrupt):
        compress_context(model, cache, ids)
    assert cache.layers == layers and all(layer.pass_scores is None for layer in layers)
    assert all(torch.equal(a, b) for a, b in zip(_keys(cache), before, strict=True))
    assert all(layer.context_passes == 0 and layer.stored_length() == 40 for layer in layers)
    monkeypatch.setattr(context_pass, "_reconstruct", reconstruct)
    compress_context(model, cache, ids)  # a later pass runs as on a fresh prefill
    assert all(layer.stored_length() == 12 and layer.context_passes == 1 for layer in layers)


@torch.inference_mode()
def test_after_prefill_compresses_only_a_cache_that_needs_it(model):
    ids, run = _ids(40), after_prefill(model)
    full, kvzip = build_cache("full", model), build_cache("kvzip", model, **KVZIP)
    for cache in (full, kvzip):
        model(ids, cache=cache)
        assert run(cache, ids) is None
    assert [layer.stored_length() for layer in full.layers] == [40] * 3
    assert [layer.stored_length() for layer in kvzip.layers] == [12] * 3


def test_reconstruction_chunks_quote_the_previous_tokens_and_right_pad_shorter_rows():
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # row 0 is left-padded: its context is 5 6 7
    chunks = list(reconstruction_chunks(ids, mask, Prompts([90], [91], [92], []), 2))
    assert chunks[0][0].tolist() == [[90, 92, 5, 6], [90, 92, 1, 2]] and chunks[0][1] is None
    assert chunks[1][0].tolist() == [[91, 5, 6, 92, 7, 0], [91, 1, 2, 92, 3, 4]]
    assert chunks[1][1].tolist() == [[True] * 5 + [False], [True] * 6]
    assert chunks[2][0].tolist() == [[0] * 7, [91, 1, 2, 3, 4, 92, 5]]
    assert chunks[2][1].tolist() == [[False] * 7, [True] * 7]


def test_a_later_chunk_quotes_at_most_the_last_overlap_tokens_of_the_previous_one():
    ids = torch.arange(10, 35)[None]  # 25 tokens, chunks of 10
    prompts = Prompts([90], [91], [92], [])
    chunks = [c.tolist()[0] for c, valid in reconstruction_chunks(ids, None, prompts, 10)]
    assert OVERLAP == 8 and len(chunks) == 3
    assert chunks[0] == [90, 92, *range(10, 20)]
    assert chunks[1] == [91, *range(12, 20), 92, *range(20, 30)]
    assert chunks[2] == [91, *range(22, 30), 92, *range(30, 35)]


def test_the_chat_opening_is_dropped_only_where_a_row_starts_with_it():
    prompts = Prompts([], [], [], [1, 2])
    rows = torch.tensor([[1, 2, 7, 8], [3, 1, 2, 9]])
    ((chunk, valid),) = reconstruction_chunks(rows, None, prompts, 8)
    assert chunk.tolist() == [[7, 8, 0, 0], [3, 1, 2, 9]]
    assert valid.tolist() == [[True, True, False, False], [True] * 4]
    ((alone, _),) = reconstruction_chunks(torch.tensor([[1, 2]]), None, prompts, 8)
    assert alone.tolist() == [[1, 2]]  # nothing but the opening: kept, or nothing would be reconstructed
