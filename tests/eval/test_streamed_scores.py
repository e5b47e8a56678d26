"""Log-likelihoods scored as they stream (kvcompress.eval.streamed) equal lm-eval's own scoring of the
whole (B, T, V) logits bit for bit: same order, shared rows, left cut, greedy flags."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402

from kvcompress.eval.adapter import KVCompressLM  # noqa: E402
from kvcompress.eval.streamed import Scores, answer  # noqa: E402

LENGTHS = [(12, 9), (30, 4), (7, 21), (25, 13), (40, 1), (3, 3)]  # (context, continuation); some cut at 32


def _requests(lm) -> list:
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()  # noqa: E731
    requests = [((f"c{i}", "x"), ids(c), ids(k)) for i, (c, k) in enumerate(LENGTHS)]
    shared = ids(10)
    requests += [(("choice", str(t)), shared, [t]) for t in (5, 9, 77)]  # one row for three requests
    context = ids(6)
    with torch.no_grad():  # the model's own greedy continuation: its flag must be True
        greedy = lm.model.generate(torch.tensor([context]), max_new_tokens=5, do_sample=False)[0, 6:]
    return requests + [(("greedy", "x"), context, greedy.tolist())]


@pytest.mark.parametrize("policy,args", [("full", {}), ("sliding_window", {"sink_tokens": 2, "window": 8})])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_streamed_scores_equal_lm_evals_own(tiny_checkpoint, policy, args, batch_size):
    lm = KVCompressLM(
        pretrained=str(tiny_checkpoint),
        device="cpu",
        policy=policy,
        batch_size=batch_size,
        max_length=32,
        **args,
    )
    requests = _requests(lm)
    whole = HFLM._loglikelihood_tokens(lm, requests, disable_tqdm=True)  # lm-eval's, over _model_call

    def refuse(*a, **k):
        raise AssertionError("the streamed path built the whole (B, T, V) logits")

    lm._model_call = refuse
    streamed = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert streamed == whole  # every float and flag, bit for bit
    assert streamed[-1][1] is True and not any(flag for _, flag in streamed[:-1])
    assert len({ll for ll, _ in streamed[-4:-1]}) == 3  # the shared row scored each choice's own token


def test_a_continuation_that_does_not_end_its_row_is_refused():
    inps = torch.tensor([[4, 5, 6, 7]])
    scores = Scores(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 10))
    assert answer(scores, 0, inps, 4, [6, 7, 2]) == (0.0, False)
    with pytest.raises(ValueError, match="does not end row 0"):
        answer(scores, 0, inps, 4, [5, 7, 2])
    with pytest.raises(ValueError, match="does not end row 0"):
        answer(scores, 0, inps, 2, [4, 5, 6, 7])


def test_requests_cut_on_the_left_are_named_in_one_warning(tiny_checkpoint, caplog):
    lm = KVCompressLM(pretrained=str(tiny_checkpoint), device="cpu", max_length=32)
    requests = [(("a", "b"), list(range(3, 34)), [5, 6, 7]), (("c", "d"), [4, 5], [6])]  # 34 and 3 tokens
    with caplog.at_level("WARNING", logger="kvcompress.eval.streamed"):
        lm._loglikelihood_tokens(requests, disable_tqdm=True)
    cut = [r.getMessage() for r in caplog.records if "exceed max_length" in r.getMessage()]
    want = "1 of 2 requests exceed max_length=32 (+1) and lose their first tokens (the longest has 34)"
    assert cut == [want]
