"""The lm-eval adapter on a tiny random checkpoint: same scores as lm-eval's `hf` under `full`,
different under eviction, chunked streaming through the policy cache, generation with the policy cache."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import stream_logits

from kvcompress import build_cache

lm_eval = pytest.importorskip("lm_eval")
from kvcompress.eval.adapter import KVCompressLM, split_policy_args  # noqa: E402

PPL_METRICS = ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none")


def _essays_ppl(model: str, model_args: dict) -> dict:
    from kvcompress.eval import task_manager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["kvc_essays_ppl"],
        task_manager=task_manager(["kvc_essays_ppl"]),
        limit=1,
        bootstrap_iters=0,
    )


def test_full_policy_matches_stock_hf_and_eviction_changes_it(fake_cache, tiny_checkpoint):
    common = {"pretrained": str(tiny_checkpoint), "device": "cpu", "dtype": "float32", "max_length": 96}
    stock = _essays_ppl("hf", common)["results"]["kvc_essays_ppl"]
    full = _essays_ppl("kvcompress", {**common, "policy": "full", "chunk_size": 16})
    window_args = {"policy": "sliding_window", "sink_tokens": 2, "window": 8, "chunk_size": 16}
    window = _essays_ppl("kvcompress", {**common, **window_args})
    for metric in PPL_METRICS:
        assert full["results"]["kvc_essays_ppl"][metric] == pytest.approx(stock[metric], rel=1e-3)
        assert window["results"]["kvc_essays_ppl"][metric] != pytest.approx(stock[metric], rel=1e-3)
    info = full["config"]["kvcompress"]
    assert info["policy"] == {"name": "full", "storage": {"name": "dense"}} and info["chunk_size"] == 16
    assert info["forward_calls"] == info["requests"] * math.ceil(96 / 16)  # every window: 96 tokens, 6 chunks
    assert window["config"]["kvcompress"]["policy"] == {
        "name": "sliding_window",
        "sink_tokens": 2,
        "window": 8,
        "storage": {"name": "dense"},
    }


@pytest.fixture
def window_lm(tiny_checkpoint):
    return KVCompressLM(
        pretrained=str(tiny_checkpoint),
        device="cpu",
        policy="sliding_window",
        sink_tokens=2,
        window=8,
        chunk_size=5,
    )


def test_model_call_streams_in_chunks_through_a_fresh_policy_cache(window_lm):
    ids = torch.randint(3, 300, (2, 37), generator=torch.Generator().manual_seed(0))
    calls = []
    hook = window_lm.model.register_forward_hook(lambda m, a, kw, out: calls.append(1), with_kwargs=True)
    try:
        got = window_lm._model_call(ids)
        again = window_lm._model_call(ids)  # a fresh cache each call: same logits
    finally:
        hook.remove()
    assert len(calls) == 2 * math.ceil(37 / 5)
    ref = stream_logits(
        window_lm.model, ids, build_cache("sliding_window", window_lm.model, sink_tokens=2, window=8), 5
    )
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(again, got)
    full = window_lm.model(ids).logits
    assert not torch.allclose(got[:, 20:], full[:, 20:], atol=1e-4)  # eviction reached the scores
    torch.testing.assert_close(got[:, :10], full[:, :10], atol=1e-5, rtol=1e-5)  # budget not yet exceeded


def test_generation_uses_the_policy_cache_and_generation_config_eos(window_lm):
    model = window_lm.model
    context = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    out = window_lm._model_generate(context, max_length=36, stop=[], do_sample=False)
    assert out.shape == (1, 36)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kept = 2 + 8  # sink + window tokens per layer: what the policy cache holds after generation
    assert (
        window_lm.kvc_stats["cache_bytes"]
        == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * kept * head_dim * 4
    )
    ref = model.generate(context, cache=build_cache(window_lm.policy, model), max_length=36, do_sample=False)
    assert torch.equal(out, ref)
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = int(out[0, 30])  # the first generated token now ends generation
    try:
        stopped = window_lm._model_generate(context, max_length=36, stop=[], do_sample=False)
    finally:
        model.generation_config.eos_token_id = old
    assert stopped.shape[1] == 31


def test_policy_args_are_split_from_hf_args_and_validated():
    policy, rest = split_policy_args("sliding_window", {"window": 16, "max_length": 64, "dtype": "float32"})
    assert (policy.window, policy.sink_tokens) == (16, 4) and rest == {"max_length": 64, "dtype": "float32"}
    with pytest.raises(ValueError, match="policy='nope' is unknown; known policies"):
        split_policy_args("nope", {})
    with pytest.raises(ValueError, match="sliding_window.window=0"):
        split_policy_args("sliding_window", {"window": 0})
    cfg = {"_target_": "kvcompress.selectors.SlidingWindowPolicy", "window": 5}
    assert split_policy_args(cfg, {})[0].window == 5


def test_bad_chunk_size_is_rejected(tiny_checkpoint):
    with pytest.raises(ValueError, match="chunk_size=0"):
        KVCompressLM(pretrained=str(tiny_checkpoint), device="cpu", chunk_size=0)


def test_documents_that_read_calibration_text_are_refused(fake_cache, tiny_checkpoint, tmp_path):
    """low_rank calibrates on the essays' last 64 tokens (the last fake essay): its document is refused."""
    from kvcompress.eval import task_manager

    args = {"pretrained": str(tiny_checkpoint), "device": "cpu", "max_length": 96, "policy": "low_rank"}
    args |= {"rank": 4, "calibration_tokens": 64, "calibration_dir": str(tmp_path)}
    lm = KVCompressLM(**args)
    (span,) = lm.calibration_ranges
    assert span["text"] == "pg_essays" and span["tokens"][1] - span["tokens"][0] == 64
    with pytest.raises(ValueError, match="task 'kvc_essays_ppl' document 'essay3' reads characters"):
        lm_eval.simple_evaluate(
            model=lm,
            tasks=["kvc_essays_ppl"],
            task_manager=task_manager(["kvc_essays_ppl"]),
            bootstrap_iters=0,
        )


def test_packed_linears_model_arg_packs_and_keeps_the_logits(window_lm, tiny_checkpoint):
    from kvcompress.resources import packed_linears

    if packed_linears.unavailable(window_lm.model) is not None:
        pytest.skip("no oneDNN linear in this torch build")
    args = {"pretrained": str(tiny_checkpoint), "device": "cpu", "policy": "sliding_window", "sink_tokens": 2}
    packed = KVCompressLM(**args, window=8, chunk_size=5, linears="packed")
    assert not any(type(m) is torch.nn.Linear for m in packed.model.modules())
    assert any(type(m) is torch.nn.Linear for m in window_lm.model.modules())
    ids = torch.randint(2, 90, (3, 17), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed._model_call(ids), window_lm._model_call(ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="model.linears='fast' is unknown"):
        KVCompressLM(**args, linears="fast")


def test_a_name_both_a_field_and_an_hf_argument_needs_its_prefix():
    """``tokenizer`` is ``low_rank``'s calibration field and ``hf``'s tokenizer: a plain one is refused, the
    prefixed ones reach their owner (``hf.`` arguments go to ``hf`` without the prefix)."""
    with pytest.raises(
        ValueError, match=r"tokenizer='tok' is ambiguous.*policy.tokenizer=tok.*hf.tokenizer=tok"
    ):
        split_policy_args("low_rank", {"tokenizer": "tok"})
    policy, rest = split_policy_args("low_rank", {"hf.tokenizer": "tok", "rank": 8, "max_length": 64})
    assert rest == {"tokenizer": "tok", "max_length": 64} and policy.storage.rank == 8
    assert policy.storage.tokenizer is None
    policy, rest = split_policy_args("low_rank", {"policy.tokenizer": "calib-tok", "policy.rank": 8})
    assert rest == {} and (policy.storage.tokenizer, policy.storage.rank) == ("calib-tok", 8)
    _, rest = split_policy_args("full", {"tokenizer": "tok"})  # no field of that name: plainly hf's
    assert rest == {"tokenizer": "tok"}
    with pytest.raises(ValueError, match=r"policy.windw: policy 'sliding_window' has no field 'windw'"):
        split_policy_args("sliding_window", {"policy.windw": 3})
    for key in ("window", "policy.window"):  # a removed field: refused naming its replacement, not hf's
        with pytest.raises(ValueError, match=r"h2o.window was removed: use observation_window"):
            split_policy_args("h2o", {key: 8})
