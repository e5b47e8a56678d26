"""Several sequences through one cache (``kvcompress.runtime.padding``): left padding and its mask, each row's
own positions, a padded row fed and decoded exactly as alone, and the refusal, by name, of layers that cannot
compress a padded row as alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny

from kvcompress import build_cache
from kvcompress.runtime.padding import Padded, check_padding, inexact_layers, left_pad

G = torch.Generator().manual_seed(3)
ROWS = [torch.randint(2, 95, (1, n), generator=G) for n in (9, 6, 4)]
TAIL = torch.randint(2, 95, (1, 3), generator=G)  # fed after the prompt, the same in every row


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama")


def test_left_pad_pads_on_the_left_and_drops_the_mask_without_padding():
    ids, mask = left_pad([torch.tensor([[5, 6, 7]]), torch.tensor([[8]])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert left_pad([torch.tensor([[5, 6]]), torch.tensor([[8, 9]])])[1] is None


def test_left_pad_fills_with_the_pad_id_given():
    ids, mask = left_pad([torch.tensor([[5]]), torch.tensor([[8, 9, 4]])], pad_id=93)
    assert ids.tolist() == [[93, 93, 5], [8, 9, 4]] and ids.dtype == torch.long
    assert mask.tolist() == [[0, 0, 1], [1, 1, 1]] and mask.dtype == torch.long


def test_each_row_counts_its_own_positions_from_its_first_real_token(model):
    ids, mask = left_pad(ROWS)
    stream = Padded(model, build_cache("full", model), mask)
    got = stream._kwargs(ids.shape[1])
    assert torch.equal(got["attention_mask"], mask)
    assert got["position_ids"].tolist() == [list(range(9)), [0] * 4 + [1, 2, 3, 4, 5], [0] * 6 + [1, 2, 3]]
    assert stream._kwargs(2)["position_ids"].tolist() == [[7, 8], [4, 5], [2, 3]]  # the last 2 slots
    assert Padded(model, build_cache("full", model), None)._kwargs(5) == {}  # no padding: the model's own


@torch.inference_mode()
def _alone(model, row: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    """The row's prompt and tail fed alone: the tail's logits (1, 3, V) and ``steps`` greedy tokens."""
    stream = Padded(model, build_cache("full", model), None)
    stream.prompt(row)
    logits = stream.feed(TAIL[:, :2])
    logits = torch.cat([logits, stream.step(TAIL[:, 2:])], dim=1)
    return logits, stream.greedy(logits, steps, stop=set())[0]


@torch.inference_mode()
def test_a_padded_batch_is_fed_and_decoded_as_each_row_alone(model):
    ids, mask = left_pad(ROWS)
    stream = Padded(model, build_cache("full", model), mask)
    first = stream.prompt(ids)
    assert first.shape == (3, 1, model.config.vocab_size)
    fed = stream.feed(TAIL[:, :2].expand(3, 2))  # one token per forward
    assert stream.mask.shape == (3, 11) and bool(stream.mask[:, 9:].all())  # the mask grew with each step
    logits = torch.cat([fed, stream.step(TAIL[:, 2:].expand(3, 1))], dim=1)
    tokens = stream.greedy(logits, 4, stop=set())
    for b, row in enumerate(ROWS):
        want_logits, want_tokens = _alone(model, row, 4)
        torch.testing.assert_close(logits[b : b + 1, -1:], want_logits[:, -1:], atol=2e-5, rtol=1e-4)
        assert tokens[b] == want_tokens and len(tokens[b]) == 4


@torch.inference_mode()
def test_greedy_stops_each_row_at_its_own_stop_token_and_the_others_go_on(model):
    ids, mask = left_pad(ROWS)
    stream = Padded(model, build_cache("full", model), mask)
    logits = stream.prompt(ids)
    state = stream.snapshot()
    free = stream.greedy(logits, 5, stop=set())
    stream.restore(state)
    stop = free[0][2]  # row 0's third token
    stopped = stream.greedy(logits, 5, stop={stop})
    for row, tokens in zip(free, stopped, strict=True):
        want = row[: row.index(stop)] if stop in row else row
        assert tokens == want  # the stop token is not kept; a row that never meets it gets all 5
    assert len(stopped[0]) == 2


@torch.inference_mode()
def test_restore_returns_to_the_snapshots_cache_and_mask(model):
    ids, mask = left_pad(ROWS)
    stream = Padded(model, build_cache("full", model), mask)
    stream.prompt(ids)
    state = stream.snapshot()
    want = stream.step(TAIL.expand(3, 3))
    stream.feed(TAIL.expand(3, 3))
    assert stream.mask.shape[1] == 15 and stream.cache.get_seq_length() == 15
    stream.restore(state)
    assert torch.equal(stream.mask, mask) and stream.cache.get_seq_length() == 9
    assert torch.equal(stream.step(TAIL.expand(3, 3)), want)
    stream.restore(state)  # the snapshot stays usable
    assert stream.cache.get_seq_length() == 9


def test_layers_and_stores_that_pad_inexactly_are_named_once(model):
    assert inexact_layers(build_cache("full", model)) == []
    quant = build_cache("quant", model, bits=4, group_size=4, recent=4)
    assert inexact_layers(quant) == ["QuantStore"]  # three layers, one name

    class Exact:
        pads_exactly = True

    class Grouped:
        pads_exactly = False

    class Paged:
        pads_exactly = False

    split = SimpleNamespace(key_store=Exact(), value_store=Grouped())  # a split store: its parts count
    cache = SimpleNamespace(layers=[SimpleNamespace(store=split), Paged(), SimpleNamespace(store=Paged())])
    assert inexact_layers(cache) == ["Grouped", "Paged"]


def test_a_padded_batch_is_refused_by_name_where_a_row_would_not_be_compressed_as_alone(model):
    check_padding(build_cache("full", model), "full", "task.batch_size")  # dense: nothing to refuse
    quant = build_cache("quant", model, bits=4, group_size=4, recent=4)
    with pytest.raises(ValueError) as err:
        check_padding(quant, "quant", "task.batch_size")
    message = str(err.value)
    assert message.startswith("task.batch_size > 1 left-pads rows")
    assert "policy 'quant' (QuantStore)" in message
    assert message.endswith("Set task.batch_size=1 for this policy.")
