"""When a scoring selector evicts (``evict_at``) and by how much (budget, ratio or ``threshold``).

``evict_at`` takes the values of ``Policy.evicts``: ``prefill`` evicts at steps of several tokens only (the
prompt, each chunk of a chunked prefill; decode tokens are appended, kvpress's ``ScorerPress`` and most
papers' tables), ``always`` at decode steps too (the paper's own setting for H2O, TOVA, KeyDiff, R-KV). A
selector whose scores exist only at prefill names why (``prefill_only``) and refuses ``always``.

``threshold`` replaces the count: at a step that evicts, each (layer, KV head) keeps the pairs whose priority
is at least the threshold, plus what the selector protects (sinks, windows), so heads keep different numbers
of tokens (kvpress's ``ThresholdPress`` / ``DMSPress``; KVzip's own pruning, arXiv 2505.23416). They are
really stored so: the head-adaptive flat layout (``adaptive.AdaptiveHeads``) over dense storage. The kept
count is data-dependent, so it is read on the host once per evicting step. With ``evict_at: always``
(kvpress's ``DMSPress(decoding=True)``, KVzap's decoding) a flat layer evicts by threshold every
``threshold_every`` tokens seen, so that read-back happens once per layer every ``threshold_every`` decode
steps, not at every one; in between, pairs that fell below the threshold wait, held and counted (up to
``threshold_every - 1`` steps later than a per-step eviction would drop them; ``threshold_every: 1`` is
per-step). Served where a decode step scores each head's own pairs (``Policy.adaptive_decode``: h2o, tova,
kvzap).
"""

from __future__ import annotations

import torch

EVICT_AT = ("prefill", "always")  # the values of ``Policy.evicts`` a scoring selector can be set to
DEFAULT_RATIO = 0.5  # with neither budget nor compression_ratio set


SIZES = {
    "budget": "tokens kept per layer and head",
    "compression_ratio": "fraction removed",
    "threshold": "pairs scoring at least it are kept",
}


def check_one_budget(policy) -> None:
    """At most one of ``budget``, ``compression_ratio`` and (where the policy has it) ``threshold``; none
    means ``compression_ratio=0.5``."""
    served = getattr(type(policy), "sizes_served", tuple(SIZES))  # pyramidkv, block_evict: no threshold
    names = [n for n in served if hasattr(policy, n)]
    given = [n for n in names if getattr(policy, n) is not None]
    if not given:
        policy.compression_ratio = DEFAULT_RATIO
    elif len(given) > 1:
        each = [f"{n} ({SIZES[n]})" for n in names]
        wanted = ", ".join(each[:-1]) + " or " + each[-1]
        got = ", ".join(f"{n}={getattr(policy, n)}" for n in names)
        raise ValueError(f"{policy.name}: set exactly one of {wanted}; got {got}")


def when_refusal(policy) -> str | None:
    """Why ``policy.evict_at`` (with its ``threshold`` and ``adaptive``) cannot be served, or None."""
    name, at = policy.name, policy.evict_at
    why = type(policy).prefill_only
    if at == "always" and (why or policy.evicts != "always"):
        because = why or f"its layer evicts at {policy.evicts} only"
        return f"{name}.evict_at='always' is not served: {because}; allowed: ['prefill']"
    if policy.threshold is None:
        return None
    if policy.unit == "chunk":
        return (
            f"{name}.threshold with unit=chunk: chunks are ranked by their summed scores, so no per-pair "
            "priority is left to compare with a threshold; use unit=token (or a budget with unit=chunk)"
        )
    if at == "always" and not type(policy).adaptive_decode:
        return (
            f"{name}.threshold={policy.threshold} with evict_at='always': once heads keep their own counts "
            f"a decode step must score each head's own pairs, which {name} does not (h2o, tova and kvzap "
            "do); use evict_at=prefill"
        )
    if policy.adaptive:
        return (
            f"{name}.threshold with adaptive=true: a threshold already gives each KV head its own count; "
            "set adaptive=false"
        )
    return None


def threshold_pairs(prio: torch.Tensor, threshold: float, name: str) -> torch.Tensor:
    """Pair indices (B, N) of the pairs whose priority ``prio`` (B, H_kv, T) is at least ``threshold``,
    ascending, pair ``t * H_kv + h`` being token ``t`` of head ``h`` (``adaptive.allocate``'s layout). Every
    head keeps at least its best pair. Rows must keep the same number of pairs (one flat axis per layer)."""
    b, h, t = prio.shape
    best = prio.argmax(dim=-1, keepdim=True)  # (B, H_kv, 1): a head is never left empty
    keep = (prio >= threshold).scatter(-1, best, True)
    return kept_pairs(keep.transpose(1, 2).reshape(b, t * h), name)  # pair t * H + h


def kept_pairs(keep: torch.Tensor, name: str) -> torch.Tensor:
    """Indices (B, N) of the True entries of ``keep`` (B, pairs), ascending: the one read-back of an
    eviction by threshold (how many pass is data-dependent). Rows must keep the same number of pairs, a
    layer holding one flat axis of pairs for every row."""
    counts = keep.sum(-1).tolist()
    if len(set(counts)) > 1:
        raise ValueError(
            f"{name}.threshold: the rows of this batch keep {counts} pairs, and a layer holds one flat axis "
            "of pairs for every row; run one sequence at a time (batch 1) with a threshold"
        )
    return keep.nonzero()[:, 1].view(keep.shape[0], counts[0])
