"""The memory model's machinery: the per-layer workload, the formula registry, the sum over layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvcompress.policies import ModelSpec, Policy, PyramidKVPolicy, SchedulePolicy

DTYPE_BYTES = (1, 2, 4, 8)


class Shape(NamedTuple):
    """One layer's workload: batch rows, KV/query heads, head_dim, element bytes, prefill/decode tokens."""

    batch: int
    kv_heads: int
    heads: int
    head_dim: int
    dtype_bytes: int
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def kv(self, tokens: int) -> int:
        """Bytes of keys and values of ``tokens`` tokens in the model dtype: (B, H_kv, t, D) x 2."""
        return 2 * self.batch * self.kv_heads * tokens * self.head_dim * self.dtype_bytes


_FORMULAS: dict[type, Callable[[Policy, Shape], int | None]] = {}


def formula(cls: type):
    """Register the bytes formula of one layer of policy class ``cls`` (matched by exact type)."""

    def register(fn):
        _FORMULAS[cls] = fn
        return fn

    return register


def predicted_bytes(
    policy, spec: ModelSpec, n_tokens: int, dtype_bytes: int, batch: int = 1, decode_tokens: int = 0
) -> int | None:
    """Bytes ``policy``'s cache should hold after prefilling ``n_tokens`` and ``decode_tokens`` decode steps.

    Args:
        policy: a ``Policy`` or a name in ``conf/policy/``.
        spec: the model shape (layers, KV heads, query heads, head_dim).
        dtype_bytes: bytes per element of the model dtype (4 for float32, 2 for bfloat16/float16).

    Returns:
        The sum over layers of each layer policy's formula, or None if any layer's policy has none.
    """
    from kvcompress.cache import make_policy

    _check_inputs(n_tokens, dtype_bytes, batch, decode_tokens)
    policy = make_policy(policy)
    policy.check(spec)
    shape = Shape(
        batch, spec.num_kv_heads, spec.num_heads, spec.head_dim, dtype_bytes, n_tokens, decode_tokens
    )
    total = 0
    for i in range(spec.num_layers):
        layer_policy = layer_policy_of(policy, i, spec.num_layers)
        fn = _FORMULAS.get(type(layer_policy))
        size = None if fn is None else fn(layer_policy, shape)
        if size is None:
            return None
        total += size
    return total


def predicted_for_model(policy, model, n_tokens: int, decode_tokens: int = 0, batch: int = 1) -> int | None:
    """``predicted_bytes`` with the shape and dtype read from a loaded ``model``."""
    from kvcompress.cache import model_spec

    return predicted_bytes(policy, model_spec(model), n_tokens, model.dtype.itemsize, batch, decode_tokens)


def _check_inputs(n_tokens, dtype_bytes, batch, decode_tokens) -> None:
    for field, value, low in (
        ("n_tokens", n_tokens, 1),
        ("batch", batch, 1),
        ("decode_tokens", decode_tokens, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"predicted_bytes: {field}={value!r} must be an integer >= {low}")
    if isinstance(dtype_bytes, bool) or dtype_bytes not in DTYPE_BYTES:
        raise ValueError(f"predicted_bytes: dtype_bytes={dtype_bytes!r} is not one of {list(DTYPE_BYTES)}")


def layer_policy_of(policy: Policy, layer_idx: int, num_layers: int) -> Policy:
    """The policy that builds layer ``layer_idx``: schedules (PyramidKV's too) resolved to their rule."""
    while type(policy) in (SchedulePolicy, PyramidKVPolicy):
        if type(policy) is PyramidKVPolicy:
            policy = policy.schedule(num_layers)
        policy = policy.assignment(num_layers)[layer_idx]
    return policy
