"""Each forward's own state (``attention.ForwardState``): its padding and its layer handoff reach only that
forward's layers, a caller's own 4D mask is refused, and ``uninstall`` undoes ``install``."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from kvcompress import build_cache
from kvcompress.core import attention
from kvcompress.core.attention import KEY, ForwardState
from kvcompress.runtime.padding import left_pad


def _rows():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 90, (1, n), generator=g) for n in (20, 13)]


def test_a_forward_nested_inside_another_sees_none_of_its_state():
    """Model B runs a padded batch of the same size from inside model A's first layer: A's later layers must
    neither read B's padding nor lose their own layer handoff (a thread-local carried both)."""
    a, b = make_tiny("llama"), make_tiny("qwen2")
    ids = torch.randint(2, 90, (2, 16), generator=torch.Generator().manual_seed(1))

    def a_logits(nested: bool):
        cache = build_cache("h2o", a, budget=8, recent=2)
        hook = None
        if nested:  # B's last tokens are padding in row 1: read by A's layers, A's tokens would be too
            b_ids = torch.randint(2, 90, (2, 12), generator=torch.Generator().manual_seed(2))
            b_mask = torch.ones(2, 12, dtype=torch.long)
            b_mask[1, -5:] = 0

            def run_b(*_):
                b(
                    b_ids,
                    attention_mask=b_mask,
                    cache=build_cache("h2o", b, budget=8, recent=2),
                    use_cache=True,
                )

            hook = a.model.layers[0].register_forward_hook(run_b)
        try:
            return torch.cat(
                [a(ids[:, i : i + 4], cache=cache, use_cache=True).logits for i in (0, 4, 8, 12)], 1
            )
        finally:
            if hook is not None:
                hook.remove()

    torch.testing.assert_close(a_logits(nested=True), a_logits(nested=False), rtol=0, atol=0)


def test_a_callers_4d_mask_is_refused_not_ignored():
    model = make_tiny("llama")
    ids, mask = left_pad(_rows())
    cache = build_cache("sliding_window", model, window=8, sink_tokens=2)
    model(ids, attention_mask=mask, cache=cache, use_cache=True)  # a padded forward first
    four_d = torch.ones(2, 1, 1, cache.get_seq_length() + 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attention_mask \(2, 1, 1, 21\).*only a 2D padding mask"):
        model(ids[:, -1:], attention_mask=four_d, cache=cache, use_cache=True)


def test_no_state_outlives_its_forward():
    """Nothing of a forward stays on the model, its modules or the attention module after it returns."""
    model = make_tiny("llama")
    ids, mask = left_pad(_rows())
    model(ids, attention_mask=mask, cache=build_cache("full", model), use_cache=True)
    held = [m for m in model.modules() for v in vars(m).values() if isinstance(v, ForwardState)]
    assert not held and not any(isinstance(v, ForwardState) for v in vars(attention).values())


def test_validity_is_checked_once_per_forward_and_only_for_the_new_tokens():
    state = ForwardState(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert state.new_token_validity(2, 3, "cpu").tolist() == [[False, True, True], [True, True, True]]
    assert state.new_token_validity(2, 2, "cpu") is None  # the last two tokens are real in every row
    assert state.new_token_validity(3, 2, "cpu") is None  # another batch: not this forward's mask
    assert ForwardState(None).new_token_validity(2, 3, "cpu") is None


def test_uninstall_undoes_install():
    model = make_tiny("llama")
    before = model.config._attn_implementation
    build_cache("full", model)
    assert model.config._attn_implementation == attention.NAME and model._forward_pre_hooks
    attention.uninstall(model)
    assert model.config._attn_implementation == before
    assert not model._forward_pre_hooks and not model.model._forward_pre_hooks
    out = model(torch.tensor([[3, 4, 5]]))  # the model runs as before install
    assert out.logits.shape == (1, 3, 96) and KEY not in vars(model)


def test_update_finds_positions_and_state_in_every_form_transformers_passes():
    """transformers 5.x passes the attention's keyword arguments as ``kwargs=``, older releases a
    ``cache_kwargs`` dict by name or by position; a layer driven by hand names them. Positions whose length
    is not the step's are not the step's (None)."""
    from kvcompress.core.layer import step_inputs

    keys, state = torch.zeros(1, 2, 3, 4), ForwardState()
    pos = torch.arange(3).view(1, 3)
    extra = {"position_ids": pos, KEY: state}
    for args, kwargs in (((), {"kwargs": extra}), ((), {"cache_kwargs": extra}), ((extra,), {})):
        found_pos, found_state = step_inputs(keys, args, kwargs)
        assert found_pos is pos and found_state is state
    assert step_inputs(keys, (), {"positions": pos, "forward": state}) == (pos, state)
    assert step_inputs(keys, (), {"kwargs": {"position_ids": torch.arange(5).view(1, 5)}}) == (None, None)
    assert step_inputs(keys, (None, 7), {}) == (None, None)
