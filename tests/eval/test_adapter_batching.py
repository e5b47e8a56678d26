"""batch_size > 1 in the lm-eval adapter: every request scores as in a batch of one (full, eviction,
query-aware pages in chunks), and what cannot batch is refused by the field's name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")
from kvcompress.eval.adapter import KVCompressLM  # noqa: E402

LENGTHS = [(12, 9), (30, 4), (7, 21), (25, 13), (40, 1), (3, 3)]  # (context, continuation) tokens


def _requests():
    g = torch.Generator().manual_seed(2)
    ids = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()  # noqa: E731
    return [(("ctx", "cont"), ids(c), ids(k)) for c, k in LENGTHS]


def _scores(lm, size: int) -> list:
    lm.batch_size_per_gpu = size
    return lm._loglikelihood_tokens(_requests(), disable_tqdm=True)


@pytest.mark.parametrize(
    "policy,args,chunk",
    [
        ("full", {}, 1),
        ("h2o", {"budget": 12}, 1),
        ("sliding_window", {"sink_tokens": 2, "window": 8}, 1),
        ("h2o", {"budget": 12}, 5),  # chunks of several tokens: only equal lengths share a batch
    ],
)
def test_batched_log_likelihoods_equal_batch_one(tiny_checkpoint, policy, args, chunk):
    lm = KVCompressLM(pretrained=str(tiny_checkpoint), device="cpu", policy=policy, chunk_size=chunk, **args)
    alone = _scores(lm, 1)
    shapes = []
    hook = lm.model.register_forward_hook(lambda m, args, out: shapes.append(args[0].shape[0]))
    try:
        batched = _scores(lm, 4)
    finally:
        hook.remove()
    for (ll_a, greedy_a), (ll_b, greedy_b) in zip(alone, batched, strict=True):
        assert ll_b == pytest.approx(ll_a, abs=1e-4) and greedy_b == greedy_a
    assert max(shapes) == (4 if chunk == 1 else 1)  # chunks of several tokens: equal lengths only
    if policy != "full":  # the policy really evicted
        assert lm.compression()["tokens_evicted"] > 0


def test_auto_batch_size_and_padded_generation_of_an_inexact_policy_are_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="batch_size='auto'"):
        KVCompressLM(pretrained=str(tiny_checkpoint), device="cpu", batch_size="auto")
    lm = KVCompressLM(
        pretrained=str(tiny_checkpoint), device="cpu", policy="quant", group_size=8, batch_size=2
    )
    context = torch.tensor([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])
    mask = (context > 0).long()
    with pytest.raises(ValueError, match="Set batch_size=1"):
        lm._model_generate(context, 9, [], attention_mask=mask)
    equal = lm._model_generate(context[1:].repeat(2, 1), 9, [], attention_mask=torch.ones(2, 5))
    assert equal.shape[0] == 2  # no padding: any policy batches
