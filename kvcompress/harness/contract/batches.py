"""The contract's batch checks: a left-padded batch row by row, and beam search's reorder."""

from __future__ import annotations

import torch

from kvcompress.core.cache import build_cache
from kvcompress.harness.contract.tiny import stream_logits
from kvcompress.harness.contract.tiny import tokens as make_tokens


def _generate(model, ids, mask, policy):
    cache = build_cache(policy, model)
    out = model.generate(
        input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0
    )
    return out[:, ids.shape[1] :]


def padded_batch_matches_rows(policy, model) -> None:
    """Each row of a left-padded batch generates what it generates alone, or the policy declares it cannot
    (``pads_exactly = False``) and a padded batch is refused naming it and the fix."""
    from kvcompress.runtime.padding import check_padding, inexact_layers

    if inexact_layers(build_cache(policy, model)):
        try:
            check_padding(build_cache(policy, model), policy.name, "task.batch_size")
        except ValueError as err:
            assert "Set task.batch_size=1" in str(err), f"the refusal names no fix: {err}"
            return
        raise AssertionError("declares pads_exactly = False but a padded batch is not refused")
    long, short = make_tokens(30, seed=3), make_tokens(22, seed=4)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    batched = _generate(model, ids, mask, policy)
    assert torch.equal(batched[0], _generate(model, long, None, policy)[0]), "the longer row differs alone"
    assert torch.equal(batched[1], _generate(model, short, None, policy)[0]), "the padded row differs alone"


def _same_state(a, b) -> None:
    for field in ("valid", "pos", "left_pad", *a.per_token, *a.per_row):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), f"{field}: set in one cache only"
        if x is not None:
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6, msg=lambda m, f=field: f"{f}: {m}")
    for x, y in zip(a.store.tensors(), b.store.tensors(), strict=True):
        assert (x is None) == (y is None), "a store tensor set in one cache only"
        if x is not None:
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6, msg=lambda m: f"store: {m}")


@torch.inference_mode()
def reorder_moves_row_state(policy, model) -> None:
    """After ``reorder_cache([1, 1])`` both rows continue exactly as a cache that held row 1 twice."""
    rows = make_tokens(48, rows=2, seed=3)
    moved, reference = build_cache(policy, model), build_cache(policy, model)
    stream_logits(model, rows, moved, chunk=12)
    stream_logits(model, rows[[1, 1]], reference, chunk=12)
    moved.reorder_cache(torch.tensor([1, 1]))
    for a, b in zip(moved.layers, reference.layers, strict=True):
        _same_state(a, b)
    for t in range(8):  # decode steps: later evictions read the moved scores and pages too
        step = torch.full((2, 1), 7 + 3 * t)
        got = model(step, cache=moved, use_cache=True).logits
        torch.testing.assert_close(
            got, model(step, cache=reference, use_cache=True).logits, atol=1e-5, rtol=1e-5
        )
    assert moved.get_seq_length() == reference.get_seq_length() == 56, "positions after the reorder"
