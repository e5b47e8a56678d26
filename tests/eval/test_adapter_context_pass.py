"""Query-agnostic selectors (KVzip) under lm-eval: each log-likelihood request's context is prefilled and
compressed by the context pass, then its continuation is scored through the compressed cache; generation
compresses the prompt. A budget that covers the context gives ``full``'s scores exactly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import stream_logits

pytest.importorskip("lm_eval")
from kvcompress import build_cache  # noqa: E402
from kvcompress.eval.adapter import KVCompressLM  # noqa: E402
from kvcompress.runtime.context_pass import prefill  # noqa: E402

CONTEXT, CONTINUATION = list(range(3, 43)), [50, 51, 52, 53]
KVZIP = {"policy": "kvzip", "compression_ratio": None, "context_chunk": 16, "sink_tokens": 2}


def _lm(checkpoint, **args):
    return KVCompressLM(pretrained=str(checkpoint), device="cpu", **args)


def _score(lm, context=CONTEXT, continuation=CONTINUATION) -> float:
    return lm._loglikelihood_tokens([(("ctx", "cont"), context, continuation)], disable_tqdm=True)[0][0]


def test_each_requests_context_is_compressed_then_its_continuation_scored(tiny_checkpoint):
    lm = _lm(tiny_checkpoint, budget=8, **KVZIP)
    got = _score(lm)
    result = lm.compression()
    assert result["compressed"] is True and result["tokens_evicted"] > 0 and "warning" not in result
    # the oracle: prefill the context but its last token, compress it, stream the rest token by token
    model, ids = lm.model, torch.tensor([CONTEXT + CONTINUATION[:-1]])
    cache = build_cache(lm.policy, model)
    prefill(model, cache, ids[:, : len(CONTEXT) - 1], lm.tokenizer)
    logp = F.log_softmax(stream_logits(model, ids[:, len(CONTEXT) - 1 :], cache, 1).float(), -1)
    want = logp[0].gather(-1, torch.tensor(CONTINUATION)[:, None]).sum().item()
    assert math.isclose(got, want, rel_tol=1e-5)
    assert got != pytest.approx(_score(_lm(tiny_checkpoint, policy="full")), rel=1e-6)


def test_a_budget_that_covers_the_context_scores_as_full(tiny_checkpoint):
    """The reconstruction's tokens never enter the cache: nothing evicted means full's log-likelihood."""
    lm = _lm(tiny_checkpoint, budget=200, **KVZIP)
    assert _score(lm) == pytest.approx(_score(_lm(tiny_checkpoint, policy="full")), rel=1e-6, abs=1e-6)
    assert lm.compression()["tokens_evicted"] == 0


def test_generation_compresses_the_prompt(tiny_checkpoint):
    prompt = torch.tensor([CONTEXT])
    lm = _lm(tiny_checkpoint, budget=8, **KVZIP)
    lm._model_generate(prompt, max_length=prompt.shape[1] + 4, stop=[], do_sample=False)
    assert lm.kvc_stats["generate"]["tokens_evicted"] > 0 and lm.compression()["compressed"] is True
    covering = _lm(tiny_checkpoint, budget=200, **KVZIP)
    full = _lm(tiny_checkpoint, policy="full")
    outs = [
        m._model_generate(prompt, max_length=prompt.shape[1] + 6, stop=[], do_sample=False)
        for m in (covering, full)
    ]
    assert torch.equal(outs[0], outs[1])


def test_the_hint_of_a_context_pass_policy_says_what_can_help(tiny_checkpoint):
    lm = _lm(tiny_checkpoint, budget=200, **KVZIP)
    _score(lm)
    with pytest.warns(UserWarning, match="compresses each request's context"):
        warning = lm.compression()["warning"]
    assert "raise chunk_size" not in warning


def test_the_continuation_grows_buffers_the_context_pass_made(tiny_checkpoint):
    """The context pass runs under inference mode and its eviction leaves buffers with spare slots (kept
    tokens >= 128); the continuation, streamed under lm-eval's no_grad, grows them in place."""
    lm = _lm(tiny_checkpoint, budget=160, **KVZIP)
    context = [3 + i % 250 for i in range(300)]
    assert math.isfinite(_score(lm, context, list(range(50, 90))))
    assert lm.compression()["tokens_evicted"] > 0
