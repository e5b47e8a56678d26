"""The tiered cache (``tiered`` selector over the ``offload`` storage): exact when every page is read, the
disk tier bit-exact and leaving no file behind, device bytes within the hot budget plus one chunk, Quest's
bound per KV head, the LRU's hits and evictions."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny
from helpers import stream_logits

from kvcompress import build_cache
from kvcompress.runtime.context_pass import forward_prompt
from kvcompress.selectors.pages.block_sparse_layer import page_bounds
from kvcompress.storage.offload import page_lru
from kvcompress.storage.offload.cold import MIN_ROWS, ColdPages

IDS = torch.randint(2, 95, (1, 64), generator=torch.Generator().manual_seed(5))
SMALL = {"block_size": 4, "recent": 8, "lru_pages": 4}


def tiered(tier="host", covering=False, folder=None, **storage):
    cfg = {"name": "offload", **SMALL, "tier": tier, "dir": folder, **storage}
    policy = build_policy(top_k_blocks=3, prefill_chunk=16, storage=cfg)
    return policy.covering(IDS.shape[1]) if covering else policy


def build_policy(**params):
    from kvcompress import make_policy

    return make_policy("tiered", **params)


def _padded_stream(model, ids, mask, cache, chunk):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = []
    with torch.inference_mode():
        for s in range(0, ids.shape[1], chunk):
            e = s + chunk
            kw = dict(attention_mask=mask[:, :e], position_ids=positions[:, s:e], cache=cache)
            out.append(model(ids[:, s:e], **kw).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("chunk", [64, 9, 1])  # one prefill, chunked prefill, decode token by token
def test_every_page_read_reproduces_full(tier, chunk, tmp_path):
    model = make_tiny("llama")
    ref = stream_logits(model, IDS, build_cache("full", model), chunk)
    cache = build_cache(tiered(tier, covering=True, folder=str(tmp_path)), model)
    got = stream_logits(model, IDS, cache, chunk)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert all(s["cold_pages"] == (64 - 8) // 4 for s in cache.stats())  # the pages really left the device
    if chunk < 64:  # and came back through the LRU
        assert all(s["pages_fetched"] > 0 for s in cache.stats())


def test_every_page_read_reproduces_full_on_a_left_padded_batch():
    model = make_tiny("llama")
    ids = torch.cat([IDS, torch.cat([torch.zeros(1, 8, dtype=torch.long), IDS[:, :56]], 1)])
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    for chunk in (16, 1):
        ref = _padded_stream(model, ids, mask, build_cache("full", model), chunk)
        got = _padded_stream(model, ids, mask, build_cache(tiered(covering=True), model), chunk)
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1, 8:], ref[1, 8:], atol=1e-5, rtol=1e-5)  # real tokens


def test_fewer_pages_read_fewer_bytes_on_the_device_and_differ_from_full():
    model = make_tiny("llama")
    full = build_cache("full", model)
    ref = stream_logits(model, IDS, full, 1)
    cache = build_cache(tiered(), model)
    got = stream_logits(model, IDS, cache, 1)
    assert not torch.allclose(got[:, 20:], ref[:, 20:], atol=1e-3)  # pages were really left out
    assert cache.memory_bytes() < 0.65 * full.memory_bytes()  # 64 tokens: window, 4 pages, 14 summaries
    s = cache.stats()[0]
    assert s["host_bytes"] >= s["cold_pages"] * 2 * 4 * 2 * 16 * 4  # K+V pages of 2 heads, fp32, in the tier
    assert 0 < s["lru_hit_rate"] < 1 and s["pages_fetched"] < s["lru_lookups"]


def test_unpadded_decode_reads_pages_without_a_mask(monkeypatch):
    """A mask would make SDPA repeat the KV heads for GQA: unpadded decode steps pass none, chunks do."""
    from kvcompress.selectors.pages.tiered_layer import TieredLayer

    seen, attend = [], TieredLayer.attend

    def spy(self, query, key, value):
        out = attend(self, query, key, value)
        seen.append((query.shape[2], out))
        return out

    monkeypatch.setattr(TieredLayer, "attend", spy)
    model = make_tiny("llama")
    cache = build_cache(tiered(), model)
    got = stream_logits(model, IDS, cache, 16)  # chunks of 16, then the last tokens one at a time below
    assert any(n > 1 and out[2] is not None for n, out in seen)
    seen.clear()
    with torch.inference_mode():
        for i in range(4):
            model(IDS[:, i : i + 1], cache=cache, use_cache=True)
    fetched = [out for n, out in seen if n == 1 and out[0].shape[2] > cache.layers[0].store.keys.shape[2]]
    assert fetched and all(out[2] is None for n, out in seen)  # pages were read, with no mask
    assert got.isfinite().all()


def fetched(cold, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of ``cold`` through ``fetch_into`` (into rows 0..m-1 of a fresh tensor, ids beside)."""
    out = torch.zeros(len(idx), cold.row, dtype=cold.dtype)
    ids = torch.full((len(idx),), -1, dtype=torch.long)
    cold.fetch_into(idx.numpy(), np.arange(len(idx)), idx.numpy() + 100, out, ids)
    assert torch.equal(ids, idx + 100)
    return out


def test_disk_tier_round_trips_bit_exactly(tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        cold = ColdPages("disk", str(tmp_path), 24, dtype, torch.device("cpu"))
        rows = torch.randn(40, 24).to(dtype)
        for part in rows.split(7):  # grows its mapped file several times
            cold.append(part)
        idx = torch.tensor([39, 0, 17, 17, 5])
        assert torch.equal(fetched(cold, idx).view(torch.uint8), rows[idx].view(torch.uint8))
    model = make_tiny("llama")
    host = stream_logits(model, IDS, build_cache(tiered("host"), model), 3)
    disk = stream_logits(model, IDS, build_cache(tiered("disk", folder=str(tmp_path)), model), 3)
    assert torch.equal(host, disk)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cold_tier_holds_at_most_a_quarter_more_than_its_rows(tmp_path, tier):
    cold = ColdPages(tier, str(tmp_path), 8, torch.float32, torch.device("cpu"))
    rows = torch.randn(1000, 8)
    for part in rows.split(13):  # many small appends: the capacity grows geometrically
        cold.append(part)
        assert cold.nbytes() <= max(1.25 * cold.used + 1, MIN_ROWS) * 8 * 4
    assert cold.nbytes() >= 1000 * 8 * 4
    idx = torch.arange(999, -1, -7)
    assert torch.equal(fetched(cold, idx), rows[idx])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_page_summaries_stay_bounds_and_halve_their_bytes(dtype):
    model = make_tiny("llama")
    wide, narrow = build_cache(tiered(), model), build_cache(tiered(summary_dtype=dtype), model)
    stream_logits(model, IDS, wide, 8)
    stream_logits(model, IDS, narrow, 8)
    for a, b in zip(wide.layers[:1], narrow.layers[:1], strict=True):  # layer 0: the same keys in both
        (lo, hi), (lo16, hi16) = a.store.summaries(), b.store.summaries()
        assert lo16.dtype == getattr(torch, dtype) and lo16.shape == lo.shape
        assert (lo16.float() <= lo).all() and (hi16.float() >= hi).all()  # rounded outward
        assert (hi16.float() - hi).abs().max() <= 0.02 * hi.abs().max()  # and no further than one step
        assert lo16.nbytes * 2 == lo.nbytes
    assert narrow.memory_bytes() < wide.memory_bytes()


def _mapped_offload_files() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "kvcompress-offload" in line]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see mapped files")
def test_disk_files_are_gone_after_reset_and_after_garbage_collection(tmp_path):
    model = make_tiny("llama")
    for end in ("reset", "gc"):
        cache = build_cache(tiered("disk", folder=str(tmp_path)), model)
        stream_logits(model, IDS, cache, 8)
        assert sum(s["disk_bytes"] for s in cache.stats()) > 0 and _mapped_offload_files()
        assert list(tmp_path.iterdir()) == []  # unlinked once mapped: no name to leave behind
        if end == "reset":
            cache.reset()
            assert all(s["disk_bytes"] == 0 for s in cache.stats())
        del cache
        gc.collect()
        assert _mapped_offload_files() == []  # the mapped space itself is released


def test_a_killed_process_leaves_no_file_outside_the_configured_folder(tmp_path):
    folder = tmp_path / "cold"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from conftest import make_tiny
        from helpers import stream_logits
        import torch
        from kvcompress import build_cache, make_policy
        model = make_tiny("llama")
        storage = {{"name": "offload", "block_size": 4, "recent": 8, "lru_pages": 4, "tier": "disk",
                    "dir": {str(folder)!r}}}
        cache = build_cache(make_policy("tiered", top_k_blocks=3, storage=storage), model)
        stream_logits(model, torch.randint(2, 95, (1, 64)), cache, 4)
        assert sum(s["disk_bytes"] for s in cache.stats()) > 0
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    child_tmp = tmp_path / "tmp"  # the child's temporary folder (shared /tmp has other users' files)
    child_tmp.mkdir()
    before = set(Path(tempfile.gettempdir()).glob("kvcompress-offload*"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3]), "TMPDIR": str(child_tmp)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert {p.name for p in tmp_path.iterdir()} <= {"cold", "tmp"}
    assert list(child_tmp.rglob("kvcompress-offload*")) == []
    assert set(Path(tempfile.gettempdir()).glob("kvcompress-offload*")) == before
    assert not folder.exists() or list(folder.iterdir()) == []


def test_device_bytes_stay_within_the_hot_budget_plus_one_chunk():
    model = make_tiny("llama")
    chunk, s = 16, {**SMALL, "lru_pages": 6}
    policy = build_policy(top_k_blocks=5, prefill_chunk=chunk, storage={"name": "offload", **s})
    cache = build_cache(policy, model)
    peaks = []
    for layer in cache.layers:  # the peak: this step's tokens appended, its pages fetched, before paging out
        orig = layer.end_step
        layer.end_step = lambda _o=orig, _l=layer: (peaks.append((_l.seen, _l.memory_bytes())), _o())[1]
    ids = torch.randint(2, 95, (1, 400), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        out = forward_prompt(model, cache, ids[:, :300])  # 19 forwards of at most 16 tokens
        for t in range(300, 400):
            out = model(ids[:, t : t + 1], cache=cache)
    assert out.logits.isfinite().all() and len(peaks) == 3 * (19 + 100)
    token = 2 * 2 * 16 * 4  # one token of K and V: 2 KV heads x head_dim 16, fp32
    for seen, measured in peaks:
        hot = (s["recent"] + s["block_size"] - 1 + chunk) * token * (1 + 1 / 128)
        lru = s["lru_pages"] * (s["block_size"] * token + 2 * 2 * 8)  # pages, their ids and last use
        summaries = math.ceil(seen / s["block_size"]) * token  # key min + max per page
        assert measured <= hot + lru + summaries, (seen, measured)
    assert peaks[-1][1] < 0.4 * build_full_bytes(model, ids)  # block_size 4: summaries are 1/4 of full


def build_full_bytes(model, ids) -> int:
    full = build_cache("full", model)
    stream_logits(model, ids, full, 100)
    return full.memory_bytes() // len(full.layers)


def test_quest_bound_is_per_kv_head_max_over_its_query_heads_and_queries():
    g = torch.Generator().manual_seed(0)
    lo = torch.randn(2, 3, 5, 8, generator=g)
    hi = lo + torch.rand(2, 3, 5, 8, generator=g)
    query = torch.randn(2, 6, 4, 8, generator=g)  # 2 query heads per KV head, 4 queries
    got = page_bounds(lo, hi, query)
    for h in range(3):
        q = query[:, 2 * h : 2 * h + 2].reshape(2, 8, 1, 8)  # (B, heads x queries, 1, D)
        brute = torch.maximum(q * lo[:, h, None], q * hi[:, h, None]).sum(-1).amax(1)  # (B, P)
        torch.testing.assert_close(got[:, h], brute)


def test_lru_keeps_this_steps_pages_and_evicts_the_least_recently_used():
    lru = page_lru.grow(None, 1, 1, 3, 2, torch.float32, "cpu")
    fetched = []

    def fetch(triples, slots):  # host arrays: write each missed page's id as its row
        page = triples[2]
        fetched.extend(page.tolist())
        at = torch.from_numpy(slots)
        lru.rows.index_copy_(0, at, torch.from_numpy(page).float()[:, None].expand(-1, 2))
        lru.page.view(-1).index_copy_(0, at, torch.from_numpy(page))

    counters = {"tick": 0, "lookups": 0, "hits": 0, "pages_fetched": 0}
    # page 0 is used again at step 2, so step 3 evicts page 1 (least recently used), step 4 page 2
    for want in ([0, 1, 2], [0, -1, -1], [3, -1, -1], [0, 1, -1]):
        rows = page_lru.lookup(lru, torch.tensor([[want]]), fetch, counters)
        for j, p in enumerate(want):
            if p >= 0:
                assert rows[0, 0, j, 0] == p
    assert fetched == [0, 1, 2, 3, 1] and counters["hits"] == 2 and counters["lookups"] == 7
    assert sorted(lru.page[0, 0].tolist()) == [0, 1, 3]
    with pytest.raises(ValueError, match="pages asked in one step"):
        page_lru.lookup(lru, torch.tensor([[[0, 1, 2, 3]]]), fetch, counters)


def test_refusals_name_the_field_and_the_fix():
    model = make_tiny("llama")
    with pytest.raises(ValueError, match="storage=offload"):
        build_cache("tiered", model, storage="dense")
    with pytest.raises(ValueError, match="policy=tiered"):
        build_cache("h2o", model, storage="offload")
    with pytest.raises(ValueError, match=r"tiered.top_k_blocks=50 must be <= storage.lru_pages=38"):
        build_cache("tiered", model, top_k_blocks=50)
    with pytest.raises(ValueError, match=r"offload.tier='ssd'"):
        build_cache("tiered", model, storage={"name": "offload", "tier": "ssd"})


def test_a_read_ratio_beyond_the_device_lru_is_flagged_in_stats():
    """read_ratio 1.0 over 64 tokens asks for every cold page; the LRU holds 4: the cap is reported."""
    from kvcompress.metrics.memory import tier_summary

    model = make_tiny("llama")
    flagged = []
    for ratio in (1.0, 0.05):
        cfg = {"name": "offload", **SMALL}
        cache = build_cache(
            build_policy(top_k_blocks=3, read_ratio=ratio, prefill_chunk=16, storage=cfg), model
        )
        stream_logits(model, IDS, cache, 16)
        flagged.append(tier_summary(cache.stats())["read_ratio_capped"])
    assert flagged == [True, False]


def test_prefetching_the_next_layers_pages_changes_no_logit_and_saves_its_fetches():
    """``prefetch: on`` copies the pages each layer reads into the next layer's LRU in the same read-back:
    the logits are bit-identical, later layers find more of their pages already there, and a decode step
    still reads back one small tensor per layer-step."""
    from kvcompress.metrics.host_syncs import HostSyncs

    model = make_tiny("llama")
    runs = {}
    for mode in ("off", "on"):
        cache = build_cache(tiered(lru_pages=4, prefetch=mode), model)
        with torch.inference_mode():
            logits = stream_logits(model, IDS[:, :56], cache, 16)
            nxt = logits[:, -1:].argmax(-1)
            with HostSyncs() as syncs:
                for _ in range(4):
                    nxt = model(nxt, cache=cache).logits[:, -1:].argmax(-1)
        stats = [layer.store.stats() for layer in cache.layers]
        runs[mode] = (logits, stats, syncs.in_layers / (4 * len(cache.layers)))
    (off, stats_off, _), (on, stats_on, per_step) = runs["off"], runs["on"]
    assert torch.equal(on, off)
    assert stats_on[0]["pages_prefetched"] == 0 and all(s["pages_prefetched"] > 0 for s in stats_on[1:])
    assert all(s["pages_prefetched"] == 0 for s in stats_off)
    later_on = sum(s["lru_hits"] for s in stats_on[1:])
    later_off = sum(s["lru_hits"] for s in stats_off[1:])
    assert later_on > later_off, (later_on, later_off)
    assert per_step <= 1.0
