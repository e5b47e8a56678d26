"""Quest page selection: exact when every page is read, true bounds, honest bytes-read counters."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import kernel_or_skip, make_tiny
from helpers import Standalone, stream_logits
from transformers import DynamicCache

from kvcompress import build_cache
from kvcompress.core.executor import Unserved, execute
from kvcompress.core.plan import Call
from kvcompress.metrics.compression import attention_backends
from kvcompress.metrics.memory import read_summary
from kvcompress.selectors import BlockSparsePolicy, ModelSpec

SPEC = ModelSpec(num_layers=1, num_heads=6, num_kv_heads=2, head_dim=8, max_positions=512)


def _filled_layer(policy, n_tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = policy.layer(0, SPEC)
    keys = torch.randn(1, SPEC.num_kv_heads, n_tokens, SPEC.head_dim, generator=g)
    for t in range(0, n_tokens, 7):  # several appends: the bounds are updated incrementally
        layer.update(keys[:, :, t : t + 7], torch.randn_like(keys[:, :, t : t + 7]))
    return layer, keys


def test_covering_all_pages_reproduces_full_logits(llama, tokens):
    ref = stream_logits(llama, tokens, DynamicCache(config=llama.config), chunk=1)
    cache = build_cache("block_sparse", llama, block_size=4, top_k_blocks=12, sink_blocks=1)
    got = stream_logits(llama, tokens, cache, chunk=1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    stats = cache.stats()[0]
    assert stats["decode_steps"] == 48 and stats["pages_read_fraction"] == 1.0  # the sparse path ran


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_page_bounds_are_upper_bounds_of_qk(block_size):
    layer, keys = _filled_layer(BlockSparsePolicy(block_size=block_size, top_k_blocks=2), 45)
    query = torch.randn(1, SPEC.num_heads, SPEC.head_dim, generator=torch.Generator().manual_seed(5))
    bound = layer.page_bounds(query)  # (1, H_kv, P)
    groups = query.reshape(1, SPEC.num_kv_heads, -1, SPEC.head_dim)  # (1, H_kv, g, D)
    qk = torch.einsum("bhgd,bhtd->bhgt", groups, keys).amax(2)  # (1, H_kv, T): best head of each group
    pages = qk.split(block_size, dim=-1)
    assert bound.shape[-1] == len(pages) == math.ceil(45 / block_size)
    for p, page in enumerate(pages):
        assert (bound[..., p] >= page.amax(-1) - 1e-5).all()
        if block_size == 1:  # min == max: the bound is the dot product itself
            torch.testing.assert_close(bound[..., p], page.amax(-1))


def _elementwise_bounds(page_min, page_max, query):
    """Quest's bound as first written: one elementwise max per page and channel, then the sums."""
    b, h_kv, p, d = page_min.shape
    q = query.reshape(b, h_kv, -1, 1, d)
    bound = torch.maximum(q * page_min[:, :, None], q * page_max[:, :, None]).sum(-1).amax(2)
    return bound.masked_fill(~(page_max[..., 0] >= page_min[..., 0]), -math.inf)


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_batched_page_bounds_select_the_pages_of_the_elementwise_bound(ratio, monkeypatch):
    layer, _ = _filled_layer(BlockSparsePolicy(block_size=4, read_ratio=ratio), 200)
    g = torch.Generator().manual_seed(7)
    queries = [torch.randn(1, SPEC.num_heads, SPEC.head_dim, generator=g) for _ in range(20)]
    got = [layer.select(q) for q in queries]
    for q in queries:
        want = _elementwise_bounds(layer.page_min, layer.page_max, q[:, :, None])
        torch.testing.assert_close(layer.page_bounds(q), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(
        layer, "page_bounds", lambda q: _elementwise_bounds(layer.page_min, layer.page_max, q[:, :, None])
    )
    assert all(torch.equal(a, layer.select(q)) for a, q in zip(got, queries, strict=True))
    layer.valid = torch.ones(1, 1, 200, dtype=torch.bool)  # the general path: per-page masks, no shortcut
    assert all(torch.equal(a, layer.select(q)) for a, q in zip(got, queries, strict=True))


def test_selection_takes_best_pages_plus_sink_and_newest():
    policy = BlockSparsePolicy(block_size=4, top_k_blocks=3, sink_blocks=1)
    layer, keys = _filled_layer(policy, 30)  # pages 0..7, page 7 partial
    query = torch.zeros(1, SPEC.num_heads, SPEC.head_dim)
    query[..., 0] = 1.0
    layer.page_min[:, :, 4, 0] = 50.0  # page 4 now bounds q·k by 50 for query along channel 0
    layer.page_max[:, :, 4, 0] = 60.0
    assert layer.select(query).tolist() == [[[0, 4, 7], [0, 4, 7]]]


def test_attend_reads_only_selected_pages_and_counts_bytes():
    policy = BlockSparsePolicy(block_size=4, top_k_blocks=3, sink_blocks=1, backend="dense")
    layer = policy.layer(0, SPEC)
    keys = torch.randn(1, SPEC.num_kv_heads, 30, SPEC.head_dim)
    k_all, v_all = layer.update(keys, keys * 2)
    query = torch.randn(1, SPEC.num_heads, 1, SPEC.head_dim)
    k_read, v_read, mask = layer.attend(query, k_all, v_all)
    assert mask is None  # no padding: only real tokens are read, so SDPA needs no mask (and keeps GQA)
    pages = layer.select(query[:, :, 0])
    for h in range(SPEC.num_kv_heads):
        want = torch.cat([torch.arange(p * 4, min(p * 4 + 4, 30)) for p in pages[0, h].tolist()])
        torch.testing.assert_close(k_read[0, h], keys[0, h, want])
        torch.testing.assert_close(v_read[0, h], 2 * keys[0, h, want])
    row = 2 * SPEC.head_dim * 4  # K and V of one token (float32)
    stats = layer.stats()
    assert stats["kv_bytes_read"] == (4 + 4 + 2) * SPEC.num_kv_heads * row  # two full pages + newest (2)
    assert stats["meta_bytes_read"] == 8 * SPEC.num_kv_heads * row
    assert stats["kv_bytes_full"] == 30 * SPEC.num_kv_heads * row
    assert stats["pages_read_fraction"] == 3 / 8


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("n_tokens,block_size", [(30, 4), (64, 16), (65, 16)])
def test_pages_read_in_place_equal_attention_over_the_gathered_pages(n_tokens, block_size):
    kernel_or_skip("page_attention")
    out = {}
    for mode in ("auto", "dense"):
        policy = BlockSparsePolicy(block_size=block_size, top_k_blocks=3, backend=mode)
        layer = policy.layer(0, SPEC)
        g = torch.Generator().manual_seed(n_tokens)
        keys = torch.randn(1, SPEC.num_kv_heads, n_tokens, SPEC.head_dim, generator=g)
        k_all, v_all = layer.update(keys, torch.randn(keys.shape, generator=g))
        query = torch.randn(1, SPEC.num_heads, 1, SPEC.head_dim, generator=g)
        plan = layer.plan(query, k_all, v_all)
        assert plan.form == ("pages" if mode == "auto" else "dense")
        if mode == "auto":  # nothing was gathered: attention reads the stored buffer itself
            assert plan.read.key.data_ptr() == k_all.data_ptr()
            out[mode], _, ran = execute(plan, Call(Standalone(), query, 0.3, {}, "sdpa"))
            out[mode] = out[mode][0, 0]  # (H, D)
            assert ran == ("cpu", "pages")
        else:
            k, v = plan.read.key, plan.read.value
            assert plan.read.mask is None
            ref = torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=0.3, enable_gqa=True)
            out[mode] = ref[0, :, 0]
        out[mode + "_bytes"] = layer.stats()["kv_bytes_read"]
    torch.testing.assert_close(out["auto"], out["dense"], atol=1e-6, rtol=1e-5)
    assert out["auto_bytes"] == out["dense_bytes"]


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("block_size,ratio,sinks", [(4, 0.25, 1), (4, 0.5, 0), (16, 0.25, 2), (1, 0.1, 3)])
def test_the_kernels_page_choice_is_the_tensor_forms(block_size, ratio, sinks):
    """``fused_pages.select`` (one C++ call, lent to the selector) returns the pages of ``page_bounds`` +
    ``_select_unpadded``."""
    kernel_or_skip("page_attention")
    from kvcompress.core import kernel_slots
    from kvcompress.kernels import fused_pages

    policy = BlockSparsePolicy(block_size=block_size, read_ratio=ratio, sink_blocks=sinks)
    layer, _ = _filled_layer(policy, 203, seed=block_size)
    g = torch.Generator().manual_seed(11)
    for _ in range(25):
        q = torch.randn(1, SPEC.num_heads, SPEC.head_dim, generator=g)
        width = policy.pages_to_read_count(layer.page_min.shape[2])
        got = fused_pages.select(q, layer.page_min, layer.page_max, sinks, width)
        want = layer._select_unpadded(layer.page_bounds(q), width)
        assert got.dtype == torch.int64 and torch.equal(got, want)
        assert got[..., -1].eq(layer.page_min.shape[2] - 1).all()  # the newest page
        assert got[..., : min(sinks, width)].eq(torch.arange(min(sinks, width))).all()  # the sinks
    assert fused_pages.select in kernel_slots.lent("select_pages")  # lent by kvcompress.kernels.backends


@pytest.mark.usefixtures("kernel_isa")
def test_decode_with_pages_read_in_place_keeps_the_logits(llama, tokens, monkeypatch):
    kernel_or_skip("page_attention")
    from kvcompress.kernels import fused_pages

    calls = []
    real = fused_pages.attend
    monkeypatch.setattr(fused_pages, "attend", lambda *a: calls.append(1) or real(*a))
    logits = {}
    for mode in ("auto", "dense", "cpu"):
        cache = build_cache("block_sparse", llama, block_size=4, top_k_blocks=3, backend=mode)
        logits[mode] = stream_logits(llama, tokens, cache, chunk=1)
        assert read_summary(cache.stats())["in_place_fraction"] == (0.0 if mode == "dense" else 1.0)
        steps = 48 * llama.config.num_hidden_layers
        assert attention_backends(cache) == ({"sdpa": steps} if mode == "dense" else {"cpu": steps})
    assert len(calls) == 2 * 48 * llama.config.num_hidden_layers  # every one-token step reads pages in place
    torch.testing.assert_close(logits["auto"], logits["dense"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["cpu"], logits["auto"], atol=0, rtol=0)


def test_a_named_backend_that_cannot_read_the_pages_is_refused_by_name(tokens):
    """``cpu`` reads float32 keys only; ``auto`` gathers the pages of a bfloat16 cache instead."""
    model = make_tiny("llama", dtype=torch.bfloat16)
    stream_logits(model, tokens[:, :12], build_cache("block_sparse", model, block_size=4, top_k_blocks=2), 1)
    cache = build_cache("block_sparse", model, block_size=4, top_k_blocks=2, backend="cpu")
    with pytest.raises(Unserved, match=r"pages read \(backend 'cpu' asked for.*cpu: float32 keys"):
        stream_logits(model, tokens[:, :12], cache, chunk=1)


def _expected_reads(n_tokens, block_size, pages_to_read):
    """Tokens read (per row and head) over the decode steps of a stream of ``n_tokens``, no padding."""
    total = 0
    for stored in range(1, n_tokens + 1):  # one query token per step, the first one included
        pages = math.ceil(stored / block_size)
        k = min(pages_to_read(pages), pages)
        total += (k - 1) * block_size + stored - (pages - 1) * block_size  # newest page is partial
    return total


@pytest.mark.parametrize("top_k,ratio", [(3, None), (2, 0.25)])
def test_bytes_read_per_decode_step(top_k, ratio, llama, tokens):
    cache = build_cache("block_sparse", llama, block_size=4, top_k_blocks=top_k, read_ratio=ratio)
    stream_logits(llama, tokens, cache, chunk=1)
    rule = (lambda p: top_k) if ratio is None else (lambda p: max(math.ceil(p * ratio), 2))
    stats = cache.stats()[1]
    row = 2 * 16 * 4 * 2  # K+V of one token, head_dim 16, float32, times 2 KV heads
    assert stats["kv_bytes_read"] == _expected_reads(48, 4, rule) * row
    assert stats["kv_bytes_full"] == sum(range(1, 49)) * row
    assert stats["kv_bytes_read"] < stats["kv_bytes_full"] / 2


def test_memory_is_full_cache_plus_page_bounds(llama, tokens):
    full, sparse = build_cache("full", llama), build_cache("block_sparse", llama, block_size=5)
    stream_logits(llama, tokens, full, chunk=6)
    stream_logits(llama, tokens, sparse, chunk=6)
    meta = 2 * 3 * 2 * math.ceil(48 / 5) * 16 * 4  # min+max, layers, KV heads, pages, head_dim, float32
    assert sparse.memory_bytes() == full.memory_bytes() + meta


def test_pages_align_to_each_rows_first_real_token(llama):
    g = torch.Generator().manual_seed(4)
    short = torch.randint(2, 95, (1, 20), generator=g)
    ids = torch.cat(
        [torch.randint(2, 95, (1, 25), generator=g), torch.cat([torch.zeros(1, 5).long(), short], 1)]
    )
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)

    def run(x, m):
        cache = build_cache("block_sparse", llama, block_size=3, top_k_blocks=3)
        return llama.generate(input_ids=x, attention_mask=m, cache=cache, **kw)[:, x.shape[1] :], cache

    batched, cache = run(ids, mask)
    assert cache.layers[0].shift == [0, 1]  # row 1 starts at position 5: virtual position 6 = page 2
    assert torch.equal(batched[1], run(short, None)[0][0])


@pytest.mark.parametrize(
    "field,value", [("block_size", 0), ("sink_blocks", -1), ("top_k_blocks", 1), ("read_ratio", 1.5)]
)
def test_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=f"block_sparse.{field}"):
        BlockSparsePolicy(**{field: value})


def test_read_summary_adds_layers_per_decode_step(llama, tokens):
    cache = build_cache("block_sparse", llama, block_size=4, top_k_blocks=3)
    stream_logits(llama, tokens[:, :20], cache, chunk=1)
    summary, stats = read_summary(cache.stats()), cache.stats()
    per_step = sum(s["kv_bytes_read"] + s["meta_bytes_read"] for s in stats) / 20
    assert summary["read_bytes_per_step"] == pytest.approx(per_step)
    assert summary["pages_read_fraction"] == pytest.approx(stats[0]["pages_read_fraction"])
    read = sum(s["kv_bytes_read"] + s["meta_bytes_read"] for s in stats)
    assert summary["read_bytes_ratio"] == pytest.approx(read / sum(s["kv_bytes_full"] for s in stats))
    assert read_summary(build_cache("full", llama).stats()) == {}
