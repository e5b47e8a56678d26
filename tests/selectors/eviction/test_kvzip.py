"""KVzip: its rule on a constructed attention pattern, and the context pass over every storage (the
reconstruction's tokens never stay; without the pass nothing is evicted and the run says so)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import STORAGE_VARIANTS, make_tiny, small
from helpers import held_tensors
from transformers import DynamicCache

from kvcompress import build_cache, compress_context, make_policy
from kvcompress.core.buffers import storage_bytes
from kvcompress.core.policy import ModelSpec
from kvcompress.core.registry import make_storage
from kvcompress.runtime.context_pass import (
    PassView,
    needs_context_pass,
    prefill,
    reconstruction_chunks,
)
from kvcompress.selectors import KVzipPolicy

D = 16
SPEC = ModelSpec(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=D, max_positions=64)


def onehot(start: int, stop: int) -> torch.Tensor:
    """Keys (1, 2, stop - start, D): token j is e_j in both KV heads, so a query's entry j is its logit."""
    return torch.eye(D)[start:stop].expand(1, 2, -1, -1).clone()


def chunk_queries(logits: dict) -> torch.Tensor:
    """Queries (1, 4, 2, D) from ``{(head, query): {token: logit}}``; heads 0-1 are KV group 0, 2-3 are 1."""
    q = torch.zeros(1, 4, 2, D)
    for (h, i), row in logits.items():
        for token, logit in row.items():
            q[0, h, i, token] = logit
    return q


def reconstruct(layer, start: int, q: torch.Tensor) -> None:
    """One reconstruction chunk: its keys (tokens start, start + 1) and queries, as the model would."""
    view = PassView(layer)
    keys, _ = view.update(onehot(start, start + 2), onehot(start, start + 2))
    layer.observe_pass(q, keys, 1.0, None, *view.valid)


def test_keeps_the_pairs_with_the_highest_max_attention_per_kv_group_plus_sinks():
    layer = KVzipPolicy(budget=4, compression_ratio=None, sink_tokens=1).layer(0, SPEC)
    layer.update(onehot(0, 12), onehot(0, 12))  # the context's prefill: 12 tokens
    layer.end_step()
    layer.begin_pass()
    # group 0: one strong hit each on 3, 7 and 9. Group 1: token 5 is hit once, hard; tokens 10 and 11
    # are attended moderately by three queries: the max rule keeps 5 (a sum rule would prefer 10, 11)
    reconstruct(layer, 12, chunk_queries({(0, 0): {3: 8.0}, (1, 1): {7: 9.0}, (2, 0): {5: 10.0}}))
    many = {10: 2.0, 11: 1.5}
    reconstruct(layer, 12, chunk_queries({(0, 1): {9: 6.0}, (2, 1): many, (3, 0): many, (3, 1): many}))
    assert layer.stored_length() == 12 and layer.seen == 12  # reconstruction tokens were never stored
    layer.end_pass()
    kept = layer.keys.argmax(-1).tolist()
    assert kept == [[[0, 3, 7, 9], [0, 5, 10, 11]]]
    assert layer.seen == 12 and layer.evicted == 8 and layer.pass_scores is None


def test_max_over_a_group_not_the_mean():
    layer = KVzipPolicy(budget=2, compression_ratio=None, sink_tokens=0).layer(0, SPEC)
    layer.update(onehot(0, 12), onehot(0, 12))
    layer.end_step()
    layer.begin_pass()
    spread = {4: 1.0, 6: 0.5}
    q = {(0, 0): {2: 9.0}, (0, 1): spread, (1, 0): spread, (1, 1): spread}
    reconstruct(layer, 12, chunk_queries({**q, (2, 0): {8: 9.0}}))
    layer.end_pass()
    assert layer.keys.argmax(-1).tolist()[0][0] == [2, 4]


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama")


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 95, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("var", list(STORAGE_VARIANTS))
@torch.inference_mode()
def test_context_pass_over_every_storage_evicts_and_leaves_no_reconstruction_tokens(var, model):
    policy = dataclasses.replace(
        KVzipPolicy(**KVzipPolicy.TEST_PARAMS), storage=make_storage(dict(STORAGE_VARIANTS[var]))
    )
    try:
        cache = build_cache(policy, model)
    except ValueError as err:  # a pair the storage refuses by name: per-head eviction over joint bases,
        # or any selector but tiered over offload's cold pages
        assert "cannot work" in str(err) and ("basis=head" in str(err) or "use policy=tiered" in str(err))
        return
    ids = _ids(40)
    model(ids, cache=cache)
    before = [layer.store.read()[0].clone() for layer in cache.layers]  # (1, H_kv, 40, D)
    assert needs_context_pass(cache)
    info = compress_context(model, cache, ids)
    assert info["context_pass"] and info["context_chunks"] == 3  # 40 tokens, 16 per chunk
    for layer, old in zip(cache.layers, before, strict=True):
        assert layer.stored_length() == 12 and layer.get_seq_length() == 40 and layer.evicted == 28
        if var == "dense":  # every stored key is a context key, at the index it had
            idx = (layer.keys[..., None, :] == old[:, :, None]).all(-1).float().argmax(-1)  # (1, H_kv, 12)
            assert torch.equal(layer.keys, old.gather(2, idx[..., None].expand(-1, -1, -1, old.shape[-1])))
            assert bool((idx < 40).all()) and bool((idx[..., :2] == torch.arange(2)).all())  # sinks kept
    held = [t for layer in cache.layers for t in held_tensors(layer)]
    assert cache.memory_bytes() == storage_bytes(held)
    logits = model(_ids(3, seed=2), cache=cache).logits
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 43
    assert all(layer.stored_length() == 15 for layer in cache.layers)


@torch.inference_mode()
def test_covering_budget_after_the_context_pass_is_exactly_the_uncompressed_cache(model):
    ids, more = _ids(40), _ids(6, seed=3)
    ref = DynamicCache(config=model.config)
    model(ids, cache=ref)
    want = model(more, cache=ref).logits
    cache = build_cache(make_policy("kvzip", **KVzipPolicy.TEST_PARAMS).covering(40), model)
    prefill(model, cache, ids)
    assert all(layer.context_passes == 1 and layer.evicted == 0 for layer in cache.layers)
    torch.testing.assert_close(model(more, cache=cache).logits, want, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_without_the_context_pass_nothing_is_evicted(model):
    cache = build_cache("kvzip", model, **KVzipPolicy.TEST_PARAMS)
    model(_ids(40), cache=cache)
    model(_ids(2, seed=4), cache=cache)
    stats = cache.stats()
    assert all(s["tokens_evicted"] == 0 and s["context_passes"] == 0 for s in stats)


@pytest.mark.parametrize("other", ["FullPolicy", "H2OPolicy"])
def test_layers_of_other_selectors_in_a_schedule_store_none_of_the_pass(model, other):
    """A schedule mixing kvzip with another selector: the other layer sees the reconstruction as the model
    would, stores none of it and does not act on it (no scores, no eviction); the kvzip layers evict."""
    target = "kvcompress.selectors."
    budget = {"budget": 64, "compression_ratio": None} if other != "FullPolicy" else {}
    mixed = make_policy(
        {"_target_": target + "SchedulePolicy",
         "default": {"_target_": target + "KVzipPolicy", "budget": 4, "compression_ratio": None},
         "rules": [{"layers": 0, "policy": {"_target_": target + other, **budget}}]}
    )  # fmt: skip
    cache = build_cache(mixed, model)
    with torch.inference_mode():
        model(_ids(8), cache=cache)
    before = {k: v for k, v in cache.layers[0].stats().items() if k != "bytes"}
    assert compress_context(model, cache, _ids(8))["context_pass"] is True
    assert {k: v for k, v in cache.layers[0].stats().items() if k != "bytes"} == before
    assert cache.layers[0].stored_length() == 8 and not isinstance(cache.layers[0], PassView)
    assert all(layer.stored_length() == 4 for layer in cache.layers[1:])


@torch.inference_mode()
def test_left_padded_batch_compresses_each_row_as_alone(model):
    long, short = _ids(40), _ids(14, seed=5)  # the short row's context is one chunk, the long row's three
    ids = torch.cat([long, torch.cat([torch.zeros(1, 26, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :26] = 0
    policy = make_policy("kvzip", **{**KVzipPolicy.TEST_PARAMS, "budget": 10})
    cache = build_cache(policy, model)
    prefill(model, cache, ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for row, alone_ids in enumerate((long, short)):
        alone = build_cache(policy, model)
        prefill(model, alone, alone_ids)
        for layer, ref in zip(cache.layers, alone.layers, strict=True):
            real = layer.valid[row, 0] if layer.valid is not None else slice(None)
            torch.testing.assert_close(layer.keys[row][:, real], ref.keys[0], atol=1e-5, rtol=1e-5)


def test_tasks_run_the_context_pass_and_flag_a_run_that_never_got_one(char_tokenizer, tmp_path):
    import warnings

    from omegaconf import OmegaConf

    from kvcompress.harness.tasks import niah
    from kvcompress.harness.tasks import perplexity as ppl_task

    llama, policy = make_tiny("llama"), make_policy("kvzip", **KVzipPolicy.TEST_PARAMS)
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. A dog ran far away! Birds sing at dawn. " * 12)
    cfg = OmegaConf.load("kvcompress/conf/task/perplexity.yaml")
    cfg.update(text=str(text), max_tokens=48, slices=1, speed=False, progress=False)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        streamed = ppl_task.run(llama, char_tokenizer, policy, cfg)
        cfg.update(prefix_tokens=32)
        prefixed = ppl_task.run(llama, char_tokenizer, policy, cfg)
    assert streamed["compressed"] is False and "kvzip" in streamed["warning"]
    assert prefixed["compressed"] is True and prefixed["tokens_evicted"] == 3 * (32 - 12)
    cfg = OmegaConf.load("kvcompress/conf/task/niah.yaml")
    cfg.update(text=str(text), lengths=[100], depths=[50], max_new_tokens=3, progress=False)
    cfg.update(needle="Magic is 42.", question="Magic?", answer="42", extra_needles=[])
    case = niah.run(llama, char_tokenizer, policy, cfg)["cases"][0]
    assert case["compressed"] and case["tokens_evicted"] == 3 * (case["context_tokens"] - 12)


def test_the_chat_opening_is_not_reconstructed(char_tokenizer):
    from kvcompress.runtime.context_pass import repeat_prompts

    prompts = repeat_prompts(char_tokenizer)
    assert (
        char_tokenizer.decode(prompts.opening) == "[user] "
        and char_tokenizer.decode(prompts.turn) == "\n[assistant] "
    )
    ids = torch.tensor([prompts.opening + [40, 41, 42]])
    ((first, _),) = reconstruction_chunks(ids, None, prompts, 8)
    assert first[0].tolist() == prompts.first + prompts.turn + [40, 41, 42]


def test_shared_budgets_give_concentrated_layers_more_and_fit_the_total():
    from kvcompress.selectors.eviction.kvzip_budgets import shared_budgets

    sharp = torch.tensor([[10.0, 9, 8, 7, 0, 0], [0, 0, 0, 0, 0, 5]])  # layer 0: two heads (H_kv, T)
    flat = torch.tensor([[1.0, 1, 0.5, 0, 0, 0], [1.0, 1, 0.5, 0, 0, 0]])
    # 2 layers x 2 heads x 3 tokens = 12 pairs; threshold 1 gives sizes 4 and 2: (4 + 2) x 2 = 12
    assert shared_budgets([sharp, flat], 12) == [4, 2]
    assert shared_budgets([sharp, flat], 11) == [4, 1]  # 10 fits, 12 does not
    padded = torch.tensor([[-math.inf, 3.0, 2.0, 1.0]])
    assert shared_budgets([padded, padded], 4) == [2, 2]


@torch.inference_mode()
def test_model_scope_shares_the_budget_over_layers(model):
    policy = make_policy("kvzip", **{**KVzipPolicy.TEST_PARAMS, "budget_scope": "model"})
    cache = build_cache(policy, model)
    prefill(model, cache, _ids(40))
    sizes = [layer.stored_length() for layer in cache.layers]
    assert sum(sizes) <= 3 * 12 and len(set(sizes)) > 1  # within the uniform total, not uniform
    for layer, n in zip(cache.layers, sizes, strict=True):
        assert layer.evicted == 40 - n and layer.get_seq_length() == 40
    assert policy.kept_tokens(None) is None  # no per-layer formula: the shares depend on the scores


def test_speed_counts_the_context_pass_in_the_prefill(model):
    from kvcompress.metrics import measure_speed
    from kvcompress.runtime.context_pass import after_prefill

    make = lambda: build_cache("kvzip", model, **KVzipPolicy.TEST_PARAMS)  # noqa: E731
    got = measure_speed(model, _ids(40), make, 2, warmup=0, repeats=1, progress=False,
                        after_prefill=after_prefill(model))  # fmt: skip
    assert got["cache_bytes_after_decode"] == 3 * 2 * 2 * 14 * 16 * 4  # 12 kept + 2 decoded per layer


@torch.inference_mode()
def test_decode_after_the_context_pass_attends_grouped_with_sdpas_logits(model):
    """After the pass a decode query attends through kvcompress's grouped attention (the ``torch`` backend,
    as the other eviction layers do), with SDPA's logits up to float rounding."""
    ids, steps = _ids(40), _ids(4, seed=5)
    logits = {}
    for mode in (True, False):
        cache = build_cache("kvzip", model, **KVzipPolicy.TEST_PARAMS)
        prefill(model, cache, ids)
        assert all(layer.evicted > 0 for layer in cache.layers)
        for layer in cache.layers:
            layer.grouped_decode = mode
        before = sum(layer.backends_ran.get("torch", 0) for layer in cache.layers)
        logits[mode] = torch.cat([model(steps[:, i : i + 1], cache=cache).logits for i in range(4)], dim=1)
        grouped = sum(layer.backends_ran.get("torch", 0) for layer in cache.layers) - before
        assert grouped == (4 * len(cache.layers) if mode else 0)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)


def test_a_context_pass_refuses_a_tiered_layer_holding_cold_pages(model):
    """The pass reads what each layer holds densely; a tiered layer's cold pages are not in that read, so a
    schedule of kvzip and tiered is refused there by name, not reconstructed over the hot tokens only."""
    cache = build_cache(small("tiered"), model)
    with torch.inference_mode():
        model(_ids(40), cache=cache)
    assert cache.layers[0].store.cold_pages > 0
    with pytest.raises(ValueError, match=r"layer 0: tiered holds \d+ cold pages"):
        PassView(cache.layers[0])
