"""Did each part of a policy act? The storage under the selector, and SnapKV's observation window.

A storage with an exact window (``quant``, ``turboquant``, ``low_rank``: the newest ``recent`` tokens stay in
the model's dtype) encodes nothing while the window holds every token the selector keeps: ``h2o`` keeping
127 tokens over ``quant``'s 128-token window gives h2o's numbers over dense storage, and ``quant`` alone on
a 128-token text gives ``full``'s. Such a result carries ``storage_acted: false`` and a warning naming the
window. A SnapKV step whose forward (or budget) was shorter than its observation window used a shorter
window; the result counts those steps (``observation_window_cut``).
"""

from __future__ import annotations

import warnings

PARTS = ("", "values_")  # a split storage reports its values' store under ``values_``


def storage_use(stats: list[dict]) -> dict:
    """``storage_exact_window`` (the largest ``recent`` of any layer), ``storage_encoded_tokens`` (tokens
    encoded per row and head, summed over layers) and ``storage_acted``; {} when no layer's storage keeps an
    exact window (dense, offload, a model's own windowed layers)."""
    windows, encoded = [], 0
    for layer in stats:
        for part in PARTS:
            if part + "exact_window" in layer:
                windows.append(int(layer[part + "exact_window"]))
                encoded += int(layer[part + "encoded_tokens"])
    if not windows:
        return {}
    return {
        "storage_exact_window": max(windows),
        "storage_encoded_tokens": encoded,
        "storage_acted": encoded > 0,
    }


def storage_cause(cache, use: dict) -> str | None:
    """Why the storage encoded no token (its exact window held every kept token), or None when it acted."""
    if not use or use["storage_acted"]:
        return None
    stats = cache.stats()
    kept = max(int(s.get("tokens_stored", 0)) for s in stats)
    storage = cache.policy.storage.name if getattr(cache.policy, "storage", None) else "its storage"
    selector = cache.policy.selector
    who = "" if selector == "full" else f" ({selector} keeps at most that many)"
    window = use["storage_exact_window"]
    return (
        f"storage {storage!r} encoded no token: its exact window (recent={window}) keeps "
        f"the newest tokens in the model's dtype, and no layer held more than {kept} tokens{who}, so every "
        f"token stayed exact. Set the storage's recent below the tokens kept (encoding starts once a whole "
        f"group has left the window), or use a longer text"
    )


def storage_check(cache, warn: bool = True) -> dict:
    """``storage_use`` of ``cache`` plus ``storage_warning`` (also ``warnings.warn``-ed when ``warn``) when
    the storage encoded no token; {} for a cache without layer stats or without an exact window."""
    if not hasattr(cache, "stats"):
        return {}
    use = storage_use(cache.stats())
    cause = storage_cause(cache, use)
    if cause is None:
        return use
    message = f"{cause}; those numbers are {cache.policy.selector}'s over dense storage"
    if warn:
        warnings.warn(message, stacklevel=3)
    return use | {"storage_warning": message}


def window_check(cache, warn: bool = True) -> dict:
    """``observation_window_cut`` (layer-steps where SnapKV's window was longer than the compressed
    forward or than the budget, so a shorter one was used) and a ``window_warning``; {} when none."""
    stats = cache.stats() if hasattr(cache, "stats") else []
    cut = sum(int(s.get("window_cut", 0)) for s in stats)
    if not cut:
        return {}
    window = max(int(s.get("observation_window", 0)) for s in stats)
    message = (
        f"{cache.policy.selector}: in {cut} layer-steps a compressed forward had fewer tokens than the "
        f"observation window ({window}) or the budget was smaller than it: the window then was "
        "min(window, forward tokens, budget), and with the budget the smallest only the newest tokens were "
        "kept (docs/policies.md)"
    )
    if warn:
        warnings.warn(message, stacklevel=3)
    return {"observation_window_cut": cut, "window_warning": message}
