"""``unit: chunk`` (ChunkKV): whole chunks ranked by summed votes, for every score-based selector."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from test_eviction_rules import SPEC, kept, queries, step

from kvcompress import build_cache, make_policy
from kvcompress.selectors import H2OPolicy, SnapKVPolicy
from kvcompress.selectors.eviction.chunks import chunk_priority

# chunks of 4: [5 0 0 0] sums 5, [2 2.1 2.2 2.3] sums 8.6, [4 0 0 1] sums 5
SCORES = torch.tensor([[[5.0, 0, 0, 0, 2, 2.1, 2.2, 2.3, 4, 0, 0, 1]]])


def top(prio: torch.Tensor, k: int) -> list[int]:
    return sorted(prio.topk(k, dim=-1).indices[0, 0].tolist())


def test_whole_chunks_by_summed_votes_then_the_best_tokens_of_the_next():
    assert top(SCORES, 4) == [0, 6, 7, 8]  # token-level top-k: a bit of every chunk
    assert top(chunk_priority(SCORES, 4), 4) == [4, 5, 6, 7]
    # the tie between chunks 0 and 2 goes to the newer one; its best tokens fill the rest
    assert top(chunk_priority(SCORES, 4), 6) == [4, 5, 6, 7, 8, 11]


def test_padding_is_not_counted_and_excluded_tokens_do_not_vote():
    padded = torch.cat([torch.full((1, 1, 3), 9.0), SCORES], dim=-1)
    valid = torch.tensor([[[False] * 3 + [True] * 12]])
    assert [i - 3 for i in top(chunk_priority(padded, 4, valid), 4)] == [4, 5, 6, 7]
    free = torch.ones(1, 1, 12, dtype=torch.bool)
    free[..., 4:6] = False  # chunk 1 loses two votes: sums 5, 4.5, 5
    assert top(chunk_priority(SCORES, 4, free=free), 4) == [8, 9, 10, 11]


def test_snapkv_chunk_unit_keeps_the_chunk_around_a_hit():
    layer = SnapKVPolicy(budget=7, observation_window=2, kernel_size=1, unit="chunk", chunk_size=3).layer(
        0, SPEC
    )
    q = queries([[{4: 10.0, 9: 3.0}, {1: 10.0}]]).expand(-1, -1, 2, -1)
    step(layer, 0, 16, q)
    # head 0: chunk [3 4 5] first, then chunk [9 10 11]'s best two (9, and 11 over 10: newest wins ties);
    # head 1: chunk [0 1 2], then equal votes
    assert kept(layer)[0][0] == [3, 4, 5, 9, 11, 14, 15]
    assert kept(layer)[0][1][:3] == [0, 1, 2] and kept(layer)[0][1][-2:] == [14, 15]


def test_h2o_chunk_unit_evicts_from_the_worst_chunk_in_order():
    layer = H2OPolicy(budget=6, recent=2, observation_window=2, unit="chunk", chunk_size=2).layer(0, SPEC)
    assert layer.order_free is False  # chunks are runs of stored tokens: order must stay
    step(layer, 0, 8, queries([[{2: 9.0, 3: 8.0}, {0: 9.0}]]).expand(-1, -1, 2, -1))
    assert kept(layer)[0][0][:2] == [2, 3] and kept(layer)[0][0][-2:] == [6, 7]
    step(layer, 8, 9, queries([[{2: 9.0}, {0: 9.0}]]))
    assert layer.stored_length() == 6 and layer.keys.argmax(-1)[0, 0].tolist() == sorted(kept(layer)[0][0])


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "kvzip", "expected_attention"])
def test_chunk_unit_left_padded_batch_matches_rows_alone(name):
    from kvcompress.runtime.context_pass import prefill

    model = make_tiny("llama")
    params = {**type(make_policy(name)).TEST_PARAMS, "unit": "chunk", "chunk_size": 3}
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(2, 95, (1, 30), generator=g), torch.randint(2, 95, (1, 22), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits(x, m, pos):
        cache = build_cache(make_policy(name, **params), model)
        with torch.inference_mode():
            prefill(model, cache, x, attention_mask=m, position_ids=pos)
            nxt = torch.full((x.shape[0], 1), 7)
            pos = None if pos is None else pos[:, -1:] + 1
            m = None if m is None else torch.cat([m, torch.ones_like(nxt)], 1)
            return model(nxt, cache=cache, attention_mask=m, position_ids=pos).logits[:, -1]

    batched = logits(ids, mask, positions)
    torch.testing.assert_close(batched[0], logits(long, None, None)[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batched[1], logits(short, None, None)[0], atol=1e-4, rtol=1e-4)
