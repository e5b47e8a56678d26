"""Decode steps of the main policies never wait for the device: no ``.item()``, ``int(tensor)``,
``bool(tensor)`` or ``.tolist()`` per layer per step (counted with a CPU mock of those methods)."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from conftest import small

from kvcompress import build_cache
from kvcompress.core import profiling

MAIN = [
    "full", "quant", "sliding_window", "h2o", "snapkv", "tova", "pyramidkv", "block_sparse", "low_rank",
    "knorm", "expected_attention", "kvzip",
]  # fmt: skip
SYNCS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist")


@contextlib.contextmanager
def counting_syncs():
    """Count calls of every Tensor method that copies a value to the host (each one a sync on a GPU)."""
    calls = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def spy(name, method):
        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return method(self, *args, **kwargs)

        return wrapper

    for name, method in originals.items():
        setattr(torch.Tensor, name, spy(name, method))
    try:
        yield calls
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


@torch.inference_mode()
@pytest.mark.parametrize("name", MAIN)
def test_decode_steps_make_no_host_syncs(llama, tokens, name):
    cache = build_cache(small(name), llama)
    logits = llama(tokens[:, :40], cache=cache, use_cache=True).logits[:, -1:]
    for _ in range(2):  # past the prefill's own decisions
        logits = llama(logits.argmax(-1), cache=cache, use_cache=True).logits
    nxt = logits.argmax(-1)
    with counting_syncs() as calls:
        for _ in range(6):
            nxt = llama(nxt, cache=cache, use_cache=True).logits.argmax(-1)
    assert dict(calls) == {}, f"{name}: host syncs during 6 decode steps: {dict(calls)}"
    assert all(layer.seen == 48 for layer in cache.layers)


def test_counting_syncs_sees_item_int_and_bool():
    x = torch.tensor([3])
    with counting_syncs() as calls:
        x.item(), int(x), bool(x)
    assert calls == {"item": 1, "__int__": 1, "__bool__": 1}


def test_policy_timer_synchronises_the_device_around_each_measure(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(1))
    with profiling.timing() as timer:
        with timer.measure():
            pass
        assert len(synced) == 2 and timer.calls == 1
        with timer.measure(), timer.measure():  # nested blocks are each counted
            pass
        assert len(synced) == 6 and timer.calls == 3
        with pytest.raises(KeyError), timer.measure():  # an error inside still closes the block
            raise KeyError("x")
        assert len(synced) == 8 and timer.calls == 4 and timer._starts == []
    with timer.measure():  # disabled: no sync at all
        pass
    assert len(synced) == 8 and timer._starts == []
