"""A decode step over quantized storage reads the codes, not a dequantized copy of the whole cache: for every
package selector over every ``quant`` / ``turboquant`` test variant, a counter of whole-cache reads (the
store's dense ``read`` once it holds encoded tokens) reads 0 per layer and decode step. The exceptions are
named with why: selectors that evict at decode steps from the stored keys themselves, and those whose step
selects what is read; each of them still reads 0 where it evicts at prefill only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CELLS, STORAGE_VARIANTS, cell_policy, make_tiny

from kvcompress import build_cache
from kvcompress.storage.residual import ResidualStore

# selector -> why its decode step reads dense K/V (one whole-cache read per layer and step, at most)
DENSE_AT_DECODE = {
    "keydiff": "scores every stored key against their mean at each decode step",
    "rkv": "scores every stored key's redundancy at each decode step",
    "snapkv": "with evict_at=always (its slack) re-ranks the stored keys by the window's queries",
    "block_evict": "re-ranks blocks of stored keys at each decode step",
    "sliding_window": "its step selects what is read (the window)",
    "block_sparse": "its step selects the pages read from dense page summaries (a paged compact read is "
    "not written)",
}
PROMPT, DECODE = 64, 8
QUANT_CELLS = [
    (sel, var)
    for sel, var in CELLS
    if STORAGE_VARIANTS[var]["name"] in ("quant", "turboquant")
    and type(cell_policy(sel, var)).__module__.startswith("kvcompress.")
    and cell_policy(sel, var).refusal() is None
]


def _encoded(store) -> int:
    """Tokens held encoded (over a head split, its parts' total)."""
    if hasattr(store, "encoded_length"):
        return store.encoded_length
    return sum(_encoded(part) for part in (store.retrieval, store.streaming) if part is not None)


def _whole_cache_reads(policy, monkeypatch) -> tuple[float, list[int]]:
    """Whole-cache reads per layer and decode step, and each layer's encoded tokens after the last step
    (a prefill-time selector over channel-grouped keys encodes the prompt at the first decode step)."""
    reads = [0]
    read = ResidualStore.read

    def counted(store):
        reads[0] += bool(store.encoded_length)
        return read(store)

    monkeypatch.setattr(ResidualStore, "read", counted)
    model = make_tiny("llama")
    ids = torch.randint(2, 90, (1, PROMPT + DECODE), generator=torch.Generator().manual_seed(3))
    cache = build_cache(policy, model)
    with torch.inference_mode():
        model(ids[:, :PROMPT], cache=cache)
        reads[0] = 0
        for t in range(PROMPT, PROMPT + DECODE):
            model(ids[:, t : t + 1], cache=cache)
    return reads[0] / DECODE / len(cache.layers), [_encoded(layer.store) for layer in cache.layers]


@pytest.mark.parametrize("sel,var", QUANT_CELLS, ids=[f"{s}-{v}" for s, v in QUANT_CELLS])
def test_a_decode_step_reads_the_codes_not_a_copy_of_the_whole_cache(sel, var, monkeypatch):
    policy = cell_policy(sel, var)
    per_step, encoded = _whole_cache_reads(policy, monkeypatch)
    assert min(encoded) > 0, f"{sel} x {var}: nothing was encoded, the count would prove nothing"
    if sel in DENSE_AT_DECODE and policy.evicts != "prefill":
        assert per_step <= 1.0, f"{sel} x {var}: {per_step} whole-cache reads per layer-step"
    else:
        assert per_step == 0.0, f"{sel} x {var}: {per_step} whole-cache reads per layer-step"


@pytest.mark.parametrize("sel", ["keydiff", "rkv", "snapkv"])
def test_a_selector_scoring_stored_keys_reads_the_codes_when_it_evicts_at_prefill_only(sel, monkeypatch):
    var = next(v for s, v in QUANT_CELLS if s == sel)
    policy = cell_policy(sel, var)
    policy = dataclasses.replace(policy, evict_at="prefill", **({"slack": None} if sel != "keydiff" else {}))
    per_step, encoded = _whole_cache_reads(policy, monkeypatch)
    assert min(encoded) > 0 and per_step == 0.0
