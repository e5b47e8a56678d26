"""The memory model's machinery: per-layer policies resolved from schedules, their formulas summed."""

from __future__ import annotations

from kvcompress.core.spec import Shape
from kvcompress.selectors import ModelSpec, Policy, PyramidKVPolicy, SchedulePolicy

DTYPE_BYTES = (1, 2, 4, 8)


def layer_bytes(policy: Policy, s: Shape, layer_idx: int, window: int | None = None) -> int | None:
    """One layer's bytes: the storage of the tokens the selector keeps, plus the selector's own state. On a
    windowed layer under ``apply_to: full_attention``: the model's own window, ``kv(min(T, window - 1))``."""
    if window is not None:
        return s.kv(min(s.total, max(window - 1, 0))) if policy.apply_to == "full_attention" else None
    storage = policy.storage
    if not (declares_formula(type(policy)) and declares_formula(type(storage))):
        return None  # a subclass may change what is kept or stored: its own class must say so
    parts = policy.layer_parts(s, layer_idx)
    if parts is None:
        return None
    if policy.evicts == "always" and not storage.count_exact:
        return None  # which tokens sit in the full-precision window depends on the scores
    total = 0
    for shape, kept in parts:
        stored = storage.bytes_for(shape, kept)
        if stored is None:
            return None
        total += stored + storage.fixed_bytes(shape, layer_idx) + policy.state_bytes(shape, kept)
    return total


def declares_formula(cls) -> bool:
    """Whether ``cls``'s formulas are its own: it declares ``FORMULA = True`` itself (not only a parent), or
    its base says its formulas hold for every subclass (``FORMULA_HERITABLE``: a scorer keeps no state of
    its own) and it writes neither ``kept_tokens`` nor ``state_bytes``."""
    if "FORMULA" in cls.__dict__:
        return bool(cls.__dict__["FORMULA"])
    own = {"kept_tokens", "state_bytes"} & set(cls.__dict__)
    return bool(getattr(cls, "FORMULA_HERITABLE", False)) and not own


def predicted_bytes(
    policy, spec: ModelSpec, n_tokens: int, dtype_bytes: int, batch: int = 1, decode_tokens: int = 0
) -> int | None:
    """Bytes ``policy``'s cache should hold after prefilling ``n_tokens`` and ``decode_tokens`` decode steps.

    Args:
        policy: a ``Policy`` or a name in ``conf/policy/``.
        spec: the model shape (layers, KV heads, query heads, head_dim).
        dtype_bytes: bytes per element of the model dtype (4 for float32, 2 for bfloat16/float16).

    Returns:
        The sum over layers of each layer's formula, or None if any layer has none.
    """
    from kvcompress.core.cache import make_policy

    _check_inputs(n_tokens, dtype_bytes, batch, decode_tokens)
    policy = make_policy(policy)
    policy.check(spec)
    shape = Shape(
        batch, spec.num_kv_heads, spec.num_heads, spec.head_dim, dtype_bytes, n_tokens, decode_tokens
    )
    total = 0
    for i in range(spec.num_layers):
        size = layer_bytes(layer_policy_of(policy, i, spec.num_layers), shape, i, spec.window(i))
        if size is None:
            return None
        total += size
    return total


def predicted_for_model(policy, model, n_tokens: int, decode_tokens: int = 0, batch: int = 1) -> int | None:
    """``predicted_bytes`` with the shape and dtype read from a loaded ``model``."""
    from kvcompress.core.cache import model_spec

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
    while isinstance(policy, (SchedulePolicy, PyramidKVPolicy)):
        if isinstance(policy, PyramidKVPolicy):
            policy = policy.schedule(num_layers)
        policy = policy.assignment(num_layers)[layer_idx]
    return policy
