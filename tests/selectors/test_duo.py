"""DuoAttention's retrieval and streaming heads: the streaming heads hold exactly sinks + window and the
retrieval heads every token, in two real stores; attention from the parts and from the padded dense read
equals a float64 reference per head; the calibration's mask, attention mass, head choice and saved file."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny

from kvcompress import build_cache, make_policy
from kvcompress.core import executor
from kvcompress.core.plan import Call, Dense, Heads, Plan
from kvcompress.core.policy import ModelSpec
from kvcompress.selectors import duo_fit

FIT = {"fit_text": "random", "fit_documents": 2, "fit_tokens": 24, "fit_steps": 3}
SPEC = ModelSpec(num_layers=1, num_heads=6, num_kv_heads=3, head_dim=8, max_positions=512)
SINKS, WINDOW = 2, 5


def _layer(retrieval=(True, False, False), storage=None):
    """A duo layer over SPEC whose KV heads ``retrieval`` keep every token (set by hand, no fit)."""
    extra = {} if storage is None else {"storage": storage}
    policy = make_policy("duo", sink_tokens=SINKS, window=WINDOW, **FIT, **extra)
    policy.retrieval = torch.tensor([list(retrieval)])
    return policy.layer(0, SPEC)


def _feed(layer, steps: list[int], seed: int = 0):
    """Store random keys/values (1, 3, q, 8) for each step size; every step ended; returns all of them."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = [], []
    with torch.inference_mode():
        for q in steps:
            k, v = (torch.randn(1, 3, q, 8, generator=gen) for _ in range(2))
            layer.step(k, v)
            keys.append(k)
            values.append(v)
        layer.end_deferred()
    return torch.cat(keys, 2), torch.cat(values, 2)


def _kept(n: int) -> list[int]:
    """The slots a streaming head keeps of ``n`` stored tokens: the sinks, then the window's."""
    return list(range(SINKS)) + list(range(n - WINDOW, n)) if n > SINKS + WINDOW else list(range(n))


def test_streaming_heads_hold_exactly_sinks_and_window_and_retrieval_heads_every_token():
    layer = _layer()
    keys, values = _feed(layer, [12, 1, 1, 1, 3, 1])
    n = keys.shape[2]
    retrieval, streaming = layer.store.retrieval.read(), layer.store.streaming.read()
    assert torch.equal(retrieval[0], keys[:, [0]]) and torch.equal(retrieval[1], values[:, [0]])
    assert torch.equal(streaming[0], keys[:, 1:, _kept(n)])
    assert torch.equal(streaming[1], values[:, 1:, _kept(n)])
    assert layer.stats()["tokens_per_part"] == [n, SINKS + WINDOW]
    # the bytes are the kept tokens' only (float32, keys and values, 8 channels; no headroom below 128)
    assert layer.memory_bytes() == (1 * n + 2 * (SINKS + WINDOW)) * 2 * 8 * 4
    assert layer.evicted == n - SINKS - WINDOW


def _reference(query, keys, values, reads: list[list[int]], causal_from: int | None = None):
    """Float64 attention (B, q, H, D) of each query head over its KV head's tokens ``reads[h_kv]`` (slots of
    ``keys``/``values`` (B, H_kv, T, D)); with ``causal_from`` the step's queries see their own tokens
    causally, the step's first token sitting at slot ``causal_from`` of every read."""
    b, h, q, d = query.shape
    group = h // keys.shape[1]
    out = torch.zeros(b, q, h, d, dtype=torch.float64)
    for head in range(h):
        kv = head // group
        idx = torch.tensor(reads[kv])
        k, v = keys[:, kv, idx].double(), values[:, kv, idx].double()
        logits = query[:, head].double() @ k.transpose(-1, -2) / math.sqrt(d)  # (B, q, n)
        if causal_from is not None:
            n = len(reads[kv])
            j, i = torch.arange(n), torch.arange(q)
            logits = logits.masked_fill(j[None, :] > (n - q + i)[:, None], -math.inf)
        out[:, :, head] = torch.softmax(logits, -1) @ v
    return out


def _call(query):
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    return Call(module, query, 8**-0.5, {}, "sdpa")


def test_a_decode_step_reads_each_part_where_it_lies_as_float64_attention_does():
    layer = _layer(retrieval=(False, True, False))
    keys, values = _feed(layer, [14, 1, 1])
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(1, 3, 1, 8, generator=gen) for _ in range(2))
    query = torch.randn(1, 6, 1, 8, generator=gen)
    with torch.inference_mode():
        key, value = layer.step(k, v)  # deferred: the parts are read in place
        plan = layer.plan(query, key, value)
        assert isinstance(plan.read, Heads) and [h for h, _ in plan.read.parts] == [(1,), (0, 2)]
        backend, kernel = executor.chosen(plan, _call(query))
        out, probs = kernel(plan, _call(query))
    assert backend.name == "parts" and probs is None
    keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
    n = keys.shape[2]
    stream = list(range(SINKS)) + list(range(n - WINDOW - 1, n))  # the step's own token read before it leaves
    want = _reference(query, keys, values, [stream, list(range(n)), stream])
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_a_step_of_several_tokens_after_the_split_masks_each_head_to_its_own_tokens():
    layer = _layer(retrieval=(True, True, False))
    keys, values = _feed(layer, [12, 1, 1])
    gen = torch.Generator().manual_seed(6)
    k, v = (torch.randn(1, 3, 4, 8, generator=gen) for _ in range(2))
    query = torch.randn(1, 6, 4, 8, generator=gen)
    with torch.inference_mode():
        key, value = layer.step(k, v)  # dense: padded to the retrieval heads' length
        plan = layer.plan(query, key, value)
        assert isinstance(plan.read, Dense) and plan.read.mask is not None
        out, _ = executor.chosen(plan, _call(query))[1](plan, _call(query))
    n_before = keys.shape[2]
    keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
    stream = _kept(n_before) + list(range(n_before, n_before + 4))
    want = _reference(query, keys, values, [list(range(keys.shape[2]))] * 2 + [stream], causal_from=0)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_the_parts_backend_serves_heads_reads_only_and_returns_no_probabilities():
    parts = executor.Parts()
    read = Heads((((0,), Dense(torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8), None)),))
    call = _call(torch.zeros(1, 2, 1, 8))
    assert parts.missing(Plan(read), call) is None
    assert "probabilities" in parts.missing(Plan(read, "last"), call)
    assert "heads" in parts.missing(Plan(read.parts[0][1]), call)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"storage": {"name": "low_rank", "rank": 4, "basis": "head"}},
            r"duo over storage=low_rank cannot work.*\['dense', 'quant', 'turboquant'\]",
        ),
        ({"retrieval_ratio": 1.5}, "retrieval_ratio"),
        ({"criterion": "attention"}, r"criterion.*gates.*mass"),
        ({"window": 0}, "window"),
    ],
)
def test_bad_settings_are_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        build_cache(make_policy("duo", **FIT, **fields), make_tiny("llama"))


def test_a_layer_before_the_heads_are_ranked_is_refused():
    with pytest.raises(RuntimeError, match=r"prepare\(model\)"):
        make_policy("duo", **FIT).layer(0, SPEC)


def test_the_streaming_mask_is_sinks_and_window_causally():
    got = duo_fit.streaming_mask(9, 2, 3)
    want = [[j <= i and (j < 2 or i - j <= 3) for j in range(9)] for i in range(9)]
    assert got.tolist() == want


def test_the_far_mass_is_the_attention_outside_sinks_and_window_in_float64():
    gen = torch.Generator().manual_seed(7)
    query, key = torch.randn(1, 4, 3, 8, generator=gen), torch.randn(1, 2, 10, 8, generator=gen)
    got = duo_fit.far_mass(query, key, 0.3, sinks=1, window=2)
    want = torch.zeros(2, dtype=torch.float64)
    for h in range(4):
        for n in range(3):
            i = 7 + n  # the last 3 queries of 10
            p = torch.softmax(query[0, h, n].double() @ key[0, h // 2, : i + 1].double().T * 0.3, -1)
            want[h // 2] += sum(float(p[j]) for j in range(i + 1) if j >= 1 and i - j > 2) / 6
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_the_chosen_heads_are_the_highest_scores_over_the_model():
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.9]])
    assert duo_fit.top_heads(scores, 0.5).tolist() == [[False, True, False], [True, False, True]]
    assert int(duo_fit.top_heads(scores, 0.0).sum()) == 0 and bool(duo_fit.top_heads(scores, 1.0).all())


def test_the_fit_starts_at_full_attention_lowers_the_gates_and_is_saved_and_loaded(tmp_path):
    model = make_tiny("llama")
    args = (model, "random", 2, 24, 6, 1, 3, tmp_path)
    first = duo_fit.ranking(*args)
    assert first["source"] == "computed" and first["distill_first"] == 0.0  # every gate 1: the full model
    gates = first["gates"]
    assert gates.shape == (3, 2) and bool(((gates >= 0) & (gates <= 1)).all()) and float(gates.mean()) < 1
    assert -1 <= first["agreement"]["spearman"] <= 1
    duo_fit._MEMO.clear()
    again = duo_fit.ranking(*args)
    assert again["source"] == "disk" and torch.equal(again["gates"], gates)
    assert torch.equal(again["mass"], first["mass"])
