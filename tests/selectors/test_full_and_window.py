"""The two foundation policies: exact byte counts, real eviction, sinks chosen per row."""

from __future__ import annotations

import pytest
import torch
from helpers import stream_logits

from kvcompress import build_cache, make_policy
from kvcompress.selectors.sliding_window import SlidingWindowPolicy


def test_full_memory_is_exactly_the_uncompressed_kv(llama, tokens):
    cache = build_cache("full", llama)
    stream_logits(llama, tokens, cache, chunk=8)
    cfg = llama.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * tokens.shape[1] * head_dim * 4
    assert cache.memory_bytes() == expected  # GQA: no repeat_kv before caching


def test_window_keeps_sinks_and_recent_and_frees_the_rest(llama, tokens):
    cache = build_cache("sliding_window", llama, sink_tokens=3, window=10)
    seen_keys = []
    layer0 = cache.layers[0]
    orig = layer0.update

    def spy(k, v, *a, **kw):
        seen_keys.append(k.clone())
        return orig(k, v, *a, **kw)

    layer0.update = spy
    stream_logits(llama, tokens, cache, chunk=1)
    all_keys = torch.cat(seen_keys, dim=-2)  # (1, H_kv, 48, D)
    expected = torch.cat([all_keys[:, :, :3], all_keys[:, :, -10:]], dim=-2)
    torch.testing.assert_close(layer0.keys, expected)
    assert layer0.keys.untyped_storage().nbytes() == layer0.keys.numel() * 4  # evicted storage released
    stats = cache.stats()[0]
    assert (stats["tokens_stored"], stats["tokens_evicted"], stats["tokens_seen"]) == (13, 35, 48)


def test_window_ratio_matches_budget(llama, tokens):
    full, window = build_cache("full", llama), build_cache("sliding_window", llama, sink_tokens=2, window=10)
    stream_logits(llama, tokens, full, chunk=4)
    stream_logits(llama, tokens, window, chunk=4)
    assert window.memory_bytes() == full.memory_bytes() * 12 // 48


def test_window_sinks_are_first_real_tokens_of_each_row(llama):
    ids = torch.randint(2, 95, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = build_cache("sliding_window", llama, sink_tokens=2, window=4)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() derives them
    with torch.inference_mode():
        llama(ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.keys.shape[-2] == 6 and layer.valid.all()
    # row 1's sinks are its tokens 5 and 6 (the first real ones): recompute their keys unpadded
    ref = build_cache("full", llama)
    with torch.inference_mode():
        llama(ids[1:, 5:], cache=ref, use_cache=True)
    torch.testing.assert_close(layer.keys[1, :, :2], ref.layers[0].keys[0, :, :2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field,value", [("window", 0), ("sink_tokens", -1)])
def test_window_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=f"sliding_window.{field}"):
        SlidingWindowPolicy(**{field: value})


def test_unknown_policy_lists_known_ones(llama):
    with pytest.raises(ValueError, match="known policies: .*sliding_window"):
        build_cache("nope", llama)
    with pytest.raises(ValueError, match="no field"):
        make_policy("sliding_window", windw=3)


def _window_run(llama, ids, chunks, ring: bool, monkeypatch):
    """Logits and the final cache of a window of 128 + 2 sinks fed ``ids`` in ``chunks`` (sizes)."""
    from kvcompress.storage.dense import DenseStore

    with monkeypatch.context() as m:
        if not ring:  # no token moves in place: the window is copied at every step
            m.setattr(DenseStore, "can_refill", lambda self: False)
        cache = build_cache("sliding_window", llama, sink_tokens=2, window=128)
        out, at = [], 0
        with torch.inference_mode():
            for n in chunks:
                out.append(llama(ids[:, at : at + n], cache=cache, use_cache=True).logits)
                at += n
    return torch.cat(out, dim=1), cache


def _sorted_tokens(x):
    """Stored tokens (1, H, T, D) in a canonical order (by their first channel), for set comparison."""
    return x.gather(2, x[..., :1].argsort(dim=2).expand_as(x))


def test_window_ring_decode_equals_the_copying_window(llama, monkeypatch):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 95, (1, 400), generator=g)
    chunks = [100] + [1] * 200 + [37] + [1] * 63  # decode by ring, a chunk (ring put back in order), decode
    got, ring = _window_run(llama, ids, chunks, True, monkeypatch)
    want, copy = _window_run(llama, ids, chunks, False, monkeypatch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    layer, ref = ring.layers[0], copy.layers[0]
    assert layer._oldest == 63 and ref._oldest == 0  # the ring did rotate; the reference never does
    assert (layer.stored_length(), layer.evicted, layer.seen) == (130, 270, 400)
    torch.testing.assert_close(_sorted_tokens(layer.keys), _sorted_tokens(ref.keys))  # the same tokens
    assert ring.memory_bytes() == copy.memory_bytes()


def test_window_decode_attends_grouped_with_sdpas_logits(llama, monkeypatch):
    """A decode query attends through kvcompress's grouped attention, as the other eviction layers do,
    with SDPA's logits up to float rounding; a chunk of several queries still reads SDPA."""
    from kvcompress.selectors.window_layer import SlidingWindowLayer

    ids = torch.randint(2, 95, (1, 200), generator=torch.Generator().manual_seed(6))
    chunks = [100] + [1] * 60 + [20] + [1] * 20  # past the budget (130) by ring, a chunk, the ring again
    logits = {}
    for mode in (True, False):
        monkeypatch.setattr(SlidingWindowLayer, "grouped_decode", mode)
        logits[mode], cache = _window_run(llama, ids, chunks, True, monkeypatch)
        grouped = sum(layer.backends_ran.get("torch", 0) for layer in cache.layers)
        assert grouped == (80 * len(cache.layers) if mode else 0)  # every one-token step, no chunk
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)


def test_window_ring_moves_one_token_per_step(llama, monkeypatch):
    """Past the budget a decode step writes in place: the buffer is never reallocated."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 95, (1, 200), generator=g)
    _, cache = _window_run(llama, ids, [140], True, monkeypatch)
    layer = cache.layers[0]
    ptr = layer.keys.untyped_storage().data_ptr()
    with torch.inference_mode():
        for i in range(140, 200):
            llama(ids[:, i : i + 1], cache=cache, use_cache=True)
            assert layer.keys.untyped_storage().data_ptr() == ptr
    assert layer.stored_length() == 130 and layer.keys.shape[-2] == 130


@torch.inference_mode()
def _padded_window(llama, rows, monkeypatch, ring: bool, snapshot_at: int | None = None):
    """Logits (B, n, V) of left-padded ``rows`` streamed one token per forward (lm-eval's decode mode)
    through a window of 128 + 2 sinks; with ``snapshot_at``, the stream continues from a restored copy."""
    from kvcompress.runtime.padding import Padded, left_pad
    from kvcompress.storage.dense import DenseStore

    ids, mask = left_pad(rows)
    with monkeypatch.context() as m:
        if not ring:
            m.setattr(DenseStore, "can_refill", lambda self: False)
        first = None if mask is None else mask[:, :1]
        stream = Padded(llama, build_cache("sliding_window", llama, sink_tokens=2, window=128), first)
        out = [stream.prompt(ids[:, :1])]
        for i in range(1, ids.shape[1]):
            if i == snapshot_at:
                stream.restore(stream.snapshot())
            stream.mask = None if mask is None else mask[:, : i + 1]  # padding comes one token at a time
            kwargs = stream._kwargs(1)
            out.append(llama(ids[:, i : i + 1], cache=stream.cache, use_cache=True, **kwargs).logits)
    return torch.cat(out, 1), stream.cache


def test_window_evicts_in_place_in_a_padded_batch_as_each_row_alone(llama, monkeypatch):
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(2, 95, (1, n), generator=g) for n in (230, 200, 40)]  # row 2 is mostly padding
    got, cache = _padded_window(llama, rows, monkeypatch, ring=True)
    want, copy = _padded_window(llama, rows, monkeypatch, ring=False)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    layer = cache.layers[0]
    assert layer.pos is not None and not bool((layer.pos.diff(dim=-1) > 0).all())  # out of stored order
    assert layer.stored_length() == 130 and layer.evicted == copy.layers[0].evicted == 100
    real = [torch.where(x.valid, x.pos, -1).sort(-1).values for x in (layer, copy.layers[0])]
    assert torch.equal(*real)  # the same real tokens (which padding stays is a tie)
    for b, row in enumerate(rows):  # each real position's logits equal the row streamed alone
        alone, _ = _padded_window(llama, [row], monkeypatch, ring=True)
        n = row.shape[1]
        torch.testing.assert_close(got[b : b + 1, -n:], alone, atol=2e-5, rtol=1e-4)
    restored, _ = _padded_window(llama, rows, monkeypatch, ring=True, snapshot_at=150)
    torch.testing.assert_close(restored, got, atol=1e-6, rtol=1e-6)  # a copied cache settles by a copy


@pytest.mark.parametrize("padded", [False, True])
def test_window_settles_by_a_copy_where_its_buffer_is_not_its_own(llama, monkeypatch, padded):
    """A pending eviction settles alike by moving a token in place and, in a buffer the layer did not
    allocate, by one copy; a copied or saved cache carries no pending eviction."""
    import copy

    from kvcompress.core.cache import fork as cache_fork

    g = torch.Generator().manual_seed(6)
    if padded:
        rows = [torch.randint(2, 95, (1, n), generator=g) for n in (150, 120)]
        _, cache = _padded_window(llama, rows, monkeypatch, ring=True)
    else:
        _, cache = _window_run(llama, torch.randint(2, 95, (1, 150), generator=g), [140] + [1] * 10, True,
                               monkeypatch)  # fmt: skip
    layer = cache.layers[0]
    assert layer._pending is not None
    with torch.inference_mode():
        twin = copy.deepcopy(layer)
    twin.store.slots.clear()  # as in a loaded cache: its buffers are not written in place
    assert not twin.store.can_refill()
    assert torch.equal(twin.keys, layer.keys) and torch.equal(twin.values, layer.values)
    assert twin.stored_length() == layer.stored_length() == 130
    if padded:
        assert torch.equal(twin.pos, layer.pos) and torch.equal(twin.valid, layer.valid)
    assert cache.layers[1]._pending is not None  # not looked at yet
    fork = cache_fork(cache)
    assert all(layer._pending is None for layer in cache.layers + fork.layers)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_full_reference_bytes_of_a_batch_are_the_batch_times_one_row(family):
    """``full_cache_bytes`` measures one row and multiplies: exactly what a batch of ``full`` holds, windowed
    layers (Gemma 3's sliding ones keep 12 tokens and their positions) included."""
    from zoo import make_family

    from kvcompress.metrics.compression import full_cache_bytes

    model = make_family(family)
    cache = build_cache("full", model)
    with torch.inference_mode():
        model(torch.zeros(3, 40, dtype=torch.long), cache=cache, use_cache=True, logits_to_keep=1)
    assert full_cache_bytes(model, 40, batch=3) == cache.memory_bytes()
    assert full_cache_bytes(model, 40) * 3 == cache.memory_bytes()


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_window_on_a_models_windowed_layers_keeps_sinks_and_the_newest_by_position(family):
    """With ``apply_to: all`` the model's windowed layers track positions, so the window decides by
    position (``_priority_by_position``), not stored order: every layer keeps the sinks and the newest."""
    from zoo import make_family

    model = make_family(family)
    cache = build_cache(make_policy("sliding_window", sink_tokens=2, window=10, apply_to="all"), model)
    with torch.inference_mode():
        stream_logits(
            model, torch.randint(2, 95, (1, 48), generator=torch.Generator().manual_seed(7)), cache, 1
        )
    want = [0, 1, *range(38, 48)]
    tracked = [layer for layer in cache.layers if layer.pos is not None]
    assert tracked  # the windowed layers (and only they track positions here)
    for layer in cache.layers:
        assert layer.stored_length() == 12
        if layer.pos is not None:
            assert layer.positions()[0, 0].sort().values.tolist() == want
