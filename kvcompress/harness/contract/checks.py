"""The policy contract as plain functions: each takes a policy (at its small test parameters) and a tiny
model, and raises ``AssertionError`` saying what broke. ``tests/contract/test_policy_contract.py`` holds the
same contract for every registered policy under pytest."""

from __future__ import annotations

import torch

from kvcompress.core.buffers import storage_bytes
from kvcompress.core.cache import build_cache
from kvcompress.harness.contract.batches import padded_batch_matches_rows, reorder_moves_row_state
from kvcompress.harness.contract.tiny import (
    FAMILIES,
    held_tensors,
    make_tiny,
    max_memory_ratio,
    stream_logits,
)
from kvcompress.harness.contract.tiny import tokens as make_tokens


def update_shapes_and_dtype(policy, model) -> None:
    """``update`` returns keys and values of the model's dtype, (B, H_kv, T, D), at least the new tokens."""
    cache, seen = build_cache(policy, model), []
    for layer in cache.layers:

        def spy(k, v, *a, _orig=layer.update, **kw):
            keys, values = _orig(k, v, *a, **kw)
            seen.append((k, keys, values))
            return keys, values

        layer.update = spy
    stream_logits(model, make_tokens(), cache, chunk=16)
    for new, keys, values in seen:
        assert keys.dtype == values.dtype == new.dtype, (
            f"dtype {keys.dtype}/{values.dtype}, model {new.dtype}"
        )
        assert keys.shape[:2] == new.shape[:2] and keys.shape[-1] == new.shape[-1], (
            f"shape {tuple(keys.shape)}"
        )
        assert keys.shape[-2] >= new.shape[-2], f"returned {keys.shape[-2]} tokens, fewer than the new ones"


def seq_length_is_absolute_position(policy, model) -> None:
    """``get_seq_length()`` is the tokens consumed (30), never the tokens stored."""
    cache = build_cache(policy, model)
    stream_logits(model, make_tokens()[:, :30], cache, chunk=7)
    lengths = {cache.get_seq_length(), *(layer.get_seq_length() for layer in cache.layers)}
    assert lengths == {30}, f"after 30 tokens get_seq_length() gave {sorted(lengths)}"


def sdpa_and_eager_agree(policy, model) -> None:
    """A chunked prefill gives the same logits under the model's SDPA and eager attention."""
    from kvcompress.core.attention import set_backend

    logits = {}
    for backend in ("sdpa", "eager"):
        tiny = make_tiny(model.config.model_type)
        set_backend(tiny, backend)
        logits[backend] = stream_logits(tiny, make_tokens(), build_cache(policy, tiny), chunk=10)
    torch.testing.assert_close(logits["sdpa"], logits["eager"], atol=2e-4, rtol=1e-4)


def covering_budget_is_uncompressed(policy, model) -> None:
    """At a budget that covers every token (``covering``) the logits are ``DynamicCache``'s, in chunks of
    1, 9 and 48 tokens."""
    from transformers import DynamicCache

    ids = make_tokens()
    for chunk in (1, 9, 48):
        ref = stream_logits(model, ids, DynamicCache(config=model.config), chunk=chunk)
        got = stream_logits(model, ids, build_cache(policy.covering(ids.shape[1]), model), chunk=chunk)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda m, c=chunk: f"chunk {c}: {m}")


def memory_bytes_counts_every_tensor(policy, model) -> None:
    """``memory_bytes()`` equals the storage of every tensor the layers hold, within the declared allowance
    over ``full``."""
    ids, cache, full = make_tokens(), build_cache(policy, model), build_cache("full", model)
    stream_logits(model, ids, cache, chunk=5)
    stream_logits(model, ids, full, chunk=5)
    held = storage_bytes([t for layer in cache.layers for t in held_tensors(layer)])
    assert cache.memory_bytes() == held > 0, f"memory_bytes() {cache.memory_bytes()}, tensors held {held}"
    limit = full.memory_bytes() * max_memory_ratio(policy, model.config.num_hidden_layers)
    assert cache.memory_bytes() <= limit, f"{cache.memory_bytes()} bytes, over the allowance {limit:.0f}"


CHECKS = {f.__name__: f for f in (
    update_shapes_and_dtype, seq_length_is_absolute_position, sdpa_and_eager_agree,
    covering_budget_is_uncompressed, memory_bytes_counts_every_tensor, padded_batch_matches_rows,
    reorder_moves_row_state,
)}  # fmt: skip


def run_checks(policy, families=FAMILIES, only=None):
    """Run each check (``only``: the names to run) on a tiny model of each family; yields ``(check,
    family, error)`` with ``error`` None on a pass, else what broke (the check's message or the exception)."""
    for name, check in CHECKS.items():
        if only and name not in only:
            continue
        for family in families:
            try:
                check(policy, make_tiny(family))
            except Exception as err:  # a check's failure, or the policy raising where it must not
                yield name, family, f"{type(err).__name__}: {err}"
            else:
                yield name, family, None
