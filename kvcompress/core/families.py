"""Which decoder families kvcompress serves, and each layer's own attention (full, sliding, chunked).

The model's attention semantics win over ours: a layer that transformers runs with a sliding window or in
chunks never attends beyond them, whatever a policy keeps. Layer types come from transformers' own reading
of the config (``get_layer_types_and_kwargs``: ``layer_types``, or the older ``sliding_window``,
``use_sliding_window``/``max_window_layers`` and ``attention_chunk_size`` fields). Families whose layers keep
something other than a key/value cache are refused by name, with the reason.
"""

from __future__ import annotations

SERVED_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
WINDOWED = ("sliding_attention", "chunked_attention")
REASONS = {
    "linear_attention": "its state-space / linear-attention layers keep a recurrent state, not a KV cache",
    "hybrid": "its layers combine attention with a state-space (recurrent) state",
    "hybrid_sliding": "its layers combine sliding attention with a state-space (recurrent) state",
    "conv": "its convolution layers keep a convolution state, not a KV cache",
    "dummy": "some layers reuse another layer's KV cache (KV sharing)",
}


def attention_layout(model) -> tuple[tuple[str, ...], tuple[int | None, ...]]:
    """Per-layer attention types and windows of ``model`` (``(), ()`` when every layer is full attention);
    raises ``ValueError`` naming the family and the reason for a model kvcompress cannot serve."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = model.config.get_text_config(decoder=True)
    family = getattr(cfg, "model_type", type(model).__name__)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    moe_only = ["dummy" if t in ("moe", "mlp") else None for t in getattr(cfg, "layer_types", None) or []]
    for i, kind in enumerate(types):
        if kind in SERVED_TYPES or (kind == "dummy" and i < len(moe_only) and moe_only[i]):
            continue
        reason = REASONS.get(kind, f"its {kind!r} layers are not attention over a KV cache kvcompress knows")
        raise ValueError(
            f"model family {family!r} ({type(model).__name__}) is not supported: {reason} (layer {i}); "
            f"kvcompress serves layers of types {list(SERVED_TYPES)}"
        )
    windows = tuple(
        kw.get("sliding_window") if t in WINDOWED else None for t, kw in zip(types, kwargs, strict=True)
    )
    if all(t == "full_attention" for t in types):
        return (), ()
    return tuple(types), windows
