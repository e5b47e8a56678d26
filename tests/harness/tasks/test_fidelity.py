"""Attention recall, output error and KL against a lockstep full cache (``task=fidelity``)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny
from helpers import stream_logits
from omegaconf import OmegaConf

from kvcompress import build_cache
from kvcompress.harness.tasks.fidelity import stream
from kvcompress.harness.tasks.fidelity_report import summarize
from kvcompress.metrics.fidelity import Lockstep


def _cfg(**kw):
    return OmegaConf.create({"chunk_size": 1, "prefix_tokens": None, "every": 1, "progress": False, **kw})


def _trace(model, ids, policy, **params):
    return stream(model, ids, build_cache("full", model), build_cache(policy, model, **params), _cfg())


@pytest.fixture
def text():
    return torch.randint(2, 95, (1, 64), generator=torch.Generator().manual_seed(3))


def test_full_has_recall_exactly_one_and_kl_zero(llama, text):
    trace = _trace(llama, text, "full")
    recall = torch.tensor(trace["recall"])  # (steps, layers, KV heads)
    assert recall.shape == (63, 3, 2)
    assert bool((recall == 1.0).all())
    assert trace["kl"] == [0.0] * 63 and all(trace["top1"])
    assert torch.tensor(trace["output_error"]).abs().max() == 0
    assert torch.tensor(trace["key_error"]).abs().max() == 0


def test_sliding_window_recall_is_full_mass_on_sinks_and_window(llama, text):
    sinks, window = 2, 8
    trace = _trace(llama, text, "sliding_window", sink_tokens=sinks, window=window)
    eager = make_tiny("llama", attn="eager")  # same seed, same weights; one plain forward over the text
    with torch.no_grad():
        att = eager(text[:, :-1], output_attentions=True).attentions  # per layer (1, H, T, T)
    for i, s in enumerate(trace["layer_step"]):
        pos = torch.arange(s + 1)
        kept = (pos < sinks) | (pos >= s - window)  # sinks, the window before the query, the query itself
        for layer, a in enumerate(att):
            mass = a[0, :, s, : s + 1][:, kept].sum(-1).view(2, -1).mean(-1)  # (KV heads,) mean over group
            torch.testing.assert_close(torch.tensor(trace["recall"][i][layer]), mass, atol=2e-5, rtol=0)
    assert min(min(min(r) for r in step) for step in trace["recall"]) < 0.9  # the window really evicted
    assert torch.tensor(trace["key_error"]).abs().max() == 0  # dense storage: what is held is exact


def test_h2o_recall_never_rises_as_the_budget_shrinks(llama, text):
    means = [summarize(_trace(llama, text, "h2o", budget=b))["recall_mean"] for b in (48, 32, 24, 16, 8, 4)]
    assert all(a >= b for a, b in zip(means, means[1:], strict=False)), means
    assert means[0] < 1.0 and means[-1] < 0.6 * means[0]


def test_block_sparse_recall_counts_only_the_pages_read(llama, text):
    trace = _trace(llama, text, "block_sparse", block_size=4, top_k_blocks=3)
    recall = torch.tensor(trace["recall"])
    assert bool((recall[:11] == 1.0).all())  # 12 tokens or fewer: 3 pages hold them all
    assert recall[-1].max() < 1.0  # 3 of 16 pages read: full's mass elsewhere is not served


def test_quant_int8_recall_one_and_output_error_within_its_scales(llama, text):
    full = build_cache("full", llama)
    cache = build_cache("quant", llama, bits=8, group_size=4, recent=8)
    probes = Lockstep(full, cache)
    queries = []
    spy = probes.full.attended

    def attended(layer, query, *args):
        if layer.layer_idx == 0:
            queries.append(query.clone())
        return spy(layer, query, *args)

    probes.full.attended = attended
    for c in (full, cache):
        stream_logits(llama, text[:, :-1], c, chunk=1)
    probes.measure(True)
    with torch.no_grad():
        for c in (full, cache):
            llama(text[:, -1:], cache=c, use_cache=True)
    step = probes.step()
    assert bool((step["recall"] == 1.0).all())
    err = step["output_error"][0]  # layer 0: both runs see identical inputs, only quantization differs
    assert bool((err > 0).all())  # something was quantized
    bound = _quant_bound(cache.layers[0], probes.policy.shadow[0], queries[0])
    assert bool((err <= bound).all()), (err, bound)


def _quant_bound(layer, shadow, query) -> torch.Tensor:
    """Relative output error bound (H_kv,) from the int8 scales: |dk|, |dv| <= scale / 2 per element; a logit
    moves by at most eps = scaling * sum_d |q_d| dk_d, so ||p' - p||_1 <= exp(2 eps) - 1, and
    ||out' - out|| <= max_t ||dv_t|| + ||p' - p||_1 max_t ||v_t|| per query head."""
    keys, values = shadow.read()  # (1, H_kv, T, D) exact
    t, g = keys.shape[2], 4
    kq, vq = layer.store.encoded["keys"], layer.store.encoded["values"]
    dk = torch.zeros_like(keys)
    dv = torch.zeros_like(values)
    te = kq.scale.shape[2] * g
    dk[:, :, :te] = kq.scale.float().repeat_interleave(g, dim=2) / 2  # channel groups of g tokens
    dv[:, :, : vq.scale.shape[2]] = vq.scale.float().repeat_interleave(g, dim=3) / 2  # groups of g channels
    q = query[0, :, -1].float()  # (H, D)
    h_kv = keys.shape[1]
    grp = q.shape[0] // h_kv
    scaling = q.shape[-1] ** -0.5
    bounds = []
    for h in range(q.shape[0]):
        kv = h // grp
        eps = scaling * (q[h].abs() * dk[0, kv, :t]).sum(-1).max()
        l1 = math.expm1(2 * float(eps))
        bound = dv[0, kv, :t].norm(dim=-1).max() + l1 * values[0, kv].norm(dim=-1).max()
        bounds.append(float(bound))
    with torch.no_grad():
        rep = lambda x: x[0].repeat_interleave(grp, 0)  # noqa: E731  (H, T, D)
        p = torch.softmax(q[:, None] @ rep(keys).transpose(-1, -2) * scaling, dim=-1)
        out = (p @ rep(values))[:, 0]  # (H, D) the exact output
    b = torch.tensor(bounds).view(h_kv, grp)
    return b.pow(2).sum(-1).sqrt() / out.view(h_kv, grp, -1).norm(dim=(-1, -2))


def test_watching_tracks_positions_without_counting_them(llama, text):
    plain, watched = build_cache("tova", llama, budget=12), build_cache("tova", llama, budget=12)
    Lockstep(build_cache("full", llama), watched)
    a, b = stream_logits(llama, text, plain, chunk=4), stream_logits(llama, text, watched, chunk=4)
    torch.testing.assert_close(a, b, atol=0, rtol=0)  # watching changes nothing the policy computes
    assert watched.memory_bytes() == plain.memory_bytes()
    pos = watched.layers[1].positions()  # (1, 1, 12): TOVA keeps the same tokens in every head
    assert pos.shape[-1] == 12 and int(pos.min()) >= 0 and int(pos.max()) <= 63
    assert len(set(pos.flatten().tolist())) == 12
    with pytest.raises(ValueError, match="before the first update"):
        plain.layers[0].watch(None)


def _compare_cfg(tmp_path, **over):
    (tmp_path / "hay.txt").write_text(
        "The cat sat. A dog ran far away! Birds sing at dawn. Is it late? " * 20
    )
    cfg = OmegaConf.load("kvcompress/conf/task/compare.yaml")
    cfg.update(text=str(tmp_path / "hay.txt"), length=120, depth=50, needle="Magic is 42.", question="Magic?")
    cfg.update(answer="42", max_new_tokens=6, **over)
    return cfg


def test_compare_full_never_diverges_and_drops_nothing(llama, char_tokenizer, tmp_path):
    from kvcompress import make_policy
    from kvcompress.harness.tasks import compare

    out = compare.run(llama, char_tokenizer, make_policy("full"), _compare_cfg(tmp_path), out_dir=tmp_path)
    assert out["first_divergence"] is None and out["full_response"] == out["policy_response"]
    assert out["recall_mean"] == 1.0 and out["dropped_mass"] == 0 and out["dropped_positions"] == []
    assert out["needle"]["held_mass"] == out["needle"]["full_mass"] > 0
    assert "no divergence" in (tmp_path / "compare.md").read_text()


def test_compare_names_what_the_window_dropped(llama, char_tokenizer, tmp_path):
    from kvcompress import make_policy
    from kvcompress.harness.tasks import compare

    policy = make_policy("sliding_window", sink_tokens=2, window=16)
    out = compare.run(llama, char_tokenizer, policy, _compare_cfg(tmp_path), out_dir=tmp_path)
    query = out["prompt_tokens"] - 1 + out["probed_step"]  # position of the probed step's query
    dropped = [d["position"] for d in out["dropped_positions"]]
    assert len(dropped) == 10 and all(2 <= p < query - 16 for p in dropped)
    assert out["needle"]["full_mass"] > 0 and out["needle"]["held_mass"] == 0  # mid-context: evicted
    assert out["recall_mean"] < 0.5 and len(out["lowest_layers"]) == 3


def test_fidelity_task_writes_trace_plots_and_summary(llama, char_tokenizer, tmp_path):
    import json

    from kvcompress import make_policy
    from kvcompress.harness.summary import summarize as collect
    from kvcompress.harness.tasks import fidelity
    from kvcompress.resources.files import write_json_atomic

    (tmp_path / "t.txt").write_text("The cat sat. A dog ran far away! Birds sing at dawn. " * 10)
    cfg = OmegaConf.load("kvcompress/conf/task/fidelity.yaml")
    cfg.update(text=str(tmp_path / "t.txt"), max_tokens=80, every=5, progress=False)
    run = tmp_path / "run"
    m = fidelity.run(llama, char_tokenizer, make_policy("h2o", budget=16), cfg, out_dir=run)
    assert m["tokens_scored"] == 79 and m["steps_measured"] == 16 and m["compressed"]
    assert 0 < m["recall_min"] <= m["recall_mean"] < 1 and m["kl_mean"] > 0 and 0 < m["top1_agreement"] <= 1
    assert m["cache_ratio"] < 0.3 and m["full_perplexity"] != m["perplexity"]
    trace = json.loads((run / "fidelity.json").read_text())
    assert len(trace["recall"]) == 16 and len(trace["recall"][0]) == 3 and len(trace["kl"]) == 79
    assert (run / "recall_heatmap.png").stat().st_size > 0 and (run / "kl_steps.png").stat().st_size > 0
    with pytest.raises(ValueError, match="task.every"):
        fidelity.run(llama, char_tokenizer, make_policy("full"), OmegaConf.merge(cfg, {"every": 0}))
    write_json_atomic(
        run / "results.json", {"status": "ok", "policy_name": "h2o", "config": {}, "metrics": m}
    )
    table = collect(run)
    assert "recall_mean" in table["markdown"] and (run / "pareto_recall.png").exists()
    assert (run / "kl_steps.png").exists()


def test_quest_reading_fewer_pages_is_not_flagged_as_a_no_op(llama, char_tokenizer, tmp_path):
    import warnings

    from kvcompress import make_policy
    from kvcompress.harness.tasks import fidelity

    (tmp_path / "t.txt").write_text("The cat sat. A dog ran far away! Birds sing at dawn. " * 10)
    cfg = OmegaConf.load("kvcompress/conf/task/fidelity.yaml")
    cfg.update(text=str(tmp_path / "t.txt"), max_tokens=80, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the "did not compress" warning would fail here
        m = fidelity.run(
            llama, char_tokenizer, make_policy("block_sparse", block_size=4, top_k_blocks=3), cfg
        )
    assert m["compressed"] and m["read_ratio"] < 1 and m["recall_mean"] < 1 and "warning" not in m
    assert m["tokens_evicted"] == 0 and m["cache_ratio"] > 1  # it stores everything, plus page bounds
