"""Rolling back the newest tokens (``Cache.crop``): what assisted and prompt-lookup decoding need.

transformers' assisted decoding runs one forward over the draft's candidate tokens, keeps those the model
agrees with and crops the rest: ``cache.crop(-n)`` must leave the cache exactly as if the rejected tokens
had never come. A layer can promise that only when nothing it decided depended on them:

- its selector keeps no state that every query updates (H2O's accumulated attention, TOVA's and block
  eviction's decode-time choices, a Quest page summary that already covers them) and holds every head's
  tokens alike (not the flat layout of ``adaptive: true``): the layer's ``never_crops``;
- no eviction happened since they were stored (``tail_tokens``: the newest tokens stored as they came,
  reset by any eviction, the model's own window included);
- no padding is stored (crop removes the same tokens from every row);
- and the storage can give them back as they were (``Store.crop_refusal``): dense always; quant and
  low_rank while they sit in the exact residual window and no encoding step would have gone otherwise
  without them; offload while they are in the hot tail and no page went cold because of them.

These are functions over a cache and its layers, called by ``KVCache.crop``. Anything else is refused by
name (a ``ValueError`` saying which policy, which layer and why), never approximated.
"""

from __future__ import annotations


def conditions(layer) -> list[str]:
    """When ``crop`` succeeds for a layer that can roll back, in words (for the docs' table)."""
    mine = {
        "never": [],
        "prefill": ["no eviction since the rejected tokens came (a verification forward over the budget "
                    "is a step of several tokens, which a prefill-time selector compresses)"],
    }.get(layer.policy.evicts, ["no eviction since the rejected tokens came"])  # fmt: skip
    return mine + layer.store.crop_conditions()


def refusal(layer, n: int) -> str | None:
    """Why the newest ``n`` tokens of ``layer`` cannot be removed now, or None when removing them is exact.
    Its selector speaks first (``never_crops``), then the tokens stored since the last eviction, padding
    and the storage (``Store.crop_refusal``)."""
    why = layer.never_crops()
    if why:
        return why
    tail = layer.tail_tokens if layer.evicted == layer.tail_evicted else 0
    if n > tail:
        return (
            f"only its newest {tail} tokens were stored as they came (an eviction since then was decided "
            "with the others in view)"
        )
    if layer.valid is not None:
        return "padding is stored (crop removes the same tokens from every row)"
    return layer.store.crop_refusal(n)


def crop(cache, tokens_to_remove: int) -> None:
    """Remove the newest ``-tokens_to_remove`` tokens (transformers' convention: a negative count, 0 a no-op)
    from every layer of ``cache``, exactly, or from none: every layer is asked first, and a refusal names the
    cache's policy, the layer and why (a ``ValueError``), never approximated."""
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop({tokens_to_remove}): pass a negative count, the number of newest tokens to remove"
        )
    n, layers = -tokens_to_remove, [layer for layer in cache.layers if layer.is_initialized]
    if n == 0:
        return
    for layer in layers:
        layer.end_deferred()  # before asking: a deferred step's flush is part of what crop would undo
        why = refusal(layer, n)
        if why:
            raise ValueError(
                f"policy {cache.policy.name!r} cannot roll back its newest {n} tokens (layer "
                f"{layer.layer_idx}), as assisted and prompt-lookup decoding need: {why}"
            )
    for layer in layers:  # every layer said yes: each is cut once, not asked again
        _cut(layer, n)


def _cut(layer, n: int) -> None:
    """Remove the newest ``n`` tokens of ``layer``, once ``refusal`` said None."""
    t = layer.stored_length() - n
    layer.store.crop(n)
    for name in ("valid", "pos", *layer.per_token):
        x = getattr(layer, name)
        if x is not None:
            setattr(layer, name, x[..., :t])
    layer.seen -= n
    layer.tail_tokens -= n
