"""Attention in the low-rank latent space (``kvcompress.kernels.fused_low_rank``): the same logits as
reconstructing
keys and values for the model's attention, in every key mode, basis, residual window and GQA layout, the same
perplexity, and refusals by name."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import Compact, stream_logits

from kvcompress import build_cache
from kvcompress.metrics.compression import attention_backends
from kvcompress.metrics.perplexity import decode_perplexity
from kvcompress.selectors import LowRankPolicy

CASES = [
    {"keys": "post_rope", "basis": "head"},
    {"keys": "post_rope", "basis": "joint", "recent": 5},
    {"keys": "pre_rope", "basis": "joint"},
    {"keys": "pre_rope", "basis": "head", "recent": 3, "int8_coefficients": True},
    {"keys": "post_rope", "basis": "group", "group_size": 1, "int8_coefficients": True, "value_rank": 5},
    {"keys": "post_rope", "basis": "joint", "values": "dense"},
    {"keys": "pre_rope", "basis": "head", "values": {"name": "quant", "bits": 4, "group_size": 4}},
]


def policy(tmp_path, **kw):
    base = {"rank": 4, "calibration_text": "random", "calibration_tokens": 64}
    return LowRankPolicy(**{**base, **kw}, calibration_dir=str(tmp_path))


def _counted(cache):
    """Count the decode steps that attended from the latents."""
    calls = Compact(cache)
    return calls


@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_latent_attention_gives_the_logits_of_reconstruction(case, chunk, llama, tokens, tmp_path):
    """Prefill in chunks (reconstructed: more than one query) then one-token decode (latent)."""
    prompt, rest = tokens[:, :20], tokens[:, 20:]
    logits = {}
    for mode in ("dense", "torch"):
        cache = build_cache(policy(tmp_path, backend=mode, **case), llama)
        calls = _counted(cache)
        prefill = stream_logits(llama, prompt, cache, chunk=chunk)
        logits[mode] = torch.cat([prefill, stream_logits(llama, rest, cache, chunk=1)], dim=1)
        steps = rest.shape[1] + (19 - case.get("recent", 0) if chunk == 1 else 0)
        assert len(calls) == (0 if mode == "dense" else 3 * steps)  # one-query steps with encoded tokens
    torch.testing.assert_close(logits["torch"], logits["dense"], rtol=1e-5, atol=1e-5)


def test_perplexity_is_unchanged_by_latent_attention(tmp_path):
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, 64), generator=torch.Generator().manual_seed(3))
    ppl = {}
    for mode in ("dense", "auto"):
        cache = build_cache(policy(tmp_path, backend=mode, recent=4), model)
        calls = _counted(cache)
        ppl[mode] = decode_perplexity(model, ids, cache, progress=False)["perplexity"]
        assert len(calls) == (0 if mode == "dense" else 3 * (62 - 4))  # 63 steps, the first 5 all exact
        assert attention_backends(cache).get("torch", 0) == len(calls)  # auto: torch reads the latents
    assert abs(ppl["auto"] - ppl["dense"]) <= 1e-5 * ppl["dense"]


def test_unpadded_batch_attends_in_the_latent_space_per_row(llama, tmp_path):
    ids = torch.randint(2, 90, (2, 30), generator=torch.Generator().manual_seed(5))
    out = {}
    for mode in ("dense", "torch"):
        cache = build_cache(policy(tmp_path, backend=mode, recent=2), llama)
        calls = _counted(cache)
        out[mode] = torch.cat(
            [stream_logits(llama, ids[:, :12], cache, 12), stream_logits(llama, ids[:, 12:], cache, 1)], 1
        )
        assert len(calls) == (0 if mode == "dense" else 3 * 18)
    torch.testing.assert_close(out["torch"], out["dense"], rtol=1e-5, atol=1e-5)


def test_padded_batches_reconstruct_with_the_same_logits(llama, tmp_path):
    ids = torch.randint(2, 90, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding: every step of row 1 carries a mask, so attention reads the dense copy
    out = {}
    for mode in ("dense", "torch"):
        cache = build_cache(policy(tmp_path, backend=mode), llama)
        calls = _counted(cache)
        out[mode] = llama.generate(
            ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        ).logits  # fmt: skip
        assert not calls
    torch.testing.assert_close(torch.stack(out["torch"]), torch.stack(out["dense"]), rtol=1e-5, atol=1e-5)


def test_a_model_with_attention_sinks_reconstructs(llama, tokens, tmp_path):
    """Learned sinks (``s_aux``) are not plain softmax attention: the model's own attention reads the copy."""
    cache = build_cache(policy(tmp_path), llama)
    calls = _counted(cache)
    for module in llama.modules():
        if type(module).__name__.endswith("Attention"):
            module.sinks = torch.nn.Parameter(torch.zeros(4))
    stream_logits(llama, tokens[:, :12], cache, chunk=1)
    assert not calls


def test_the_torch_backend_under_a_selector_that_never_allows_it_is_refused(llama, tmp_path):
    storage = {"name": "low_rank", "rank": 4, "calibration_text": "random", "calibration_tokens": 64}
    with pytest.raises(ValueError, match="low_rank.backend='torch' attends in the latent space only"):
        build_cache("sliding_window", llama, window=16, storage={**storage, "backend": "torch"})
    build_cache("sliding_window", llama, window=16, storage={**storage, "backend": "auto"})
