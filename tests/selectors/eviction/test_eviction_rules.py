"""Each paper's rule on a constructed attention pattern: the kept tokens are the ones the rule picks.

Keys are one-hot (key j = e_j), so a query's j-th entry is exactly its logit for original token j, and
the logits stay attached to the tokens through eviction.
"""

from __future__ import annotations

import pytest
import torch

from kvcompress.core.policy import ModelSpec
from kvcompress.selectors import H2OPolicy, SnapKVPolicy, TOVAPolicy

D = 16
SPEC = ModelSpec(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=D, max_positions=64)


def onehot_keys(batch: int, start: int, stop: int) -> torch.Tensor:
    """Keys (B, 2, stop - start, D) of tokens start..stop-1, token j = e_j in every head."""
    eye = torch.eye(D)[start:stop]
    return eye.expand(batch, 2, -1, -1).clone()


def queries(logits: list[list[dict]]) -> torch.Tensor:
    """Queries (B, 2, 1, D) from per-row, per-head ``{token: logit}`` dicts."""
    q = torch.zeros(len(logits), 2, 1, D)
    for b, row in enumerate(logits):
        for h, head in enumerate(row):
            for token, logit in head.items():
                q[b, h, 0, token] = logit
    return q


def step(layer, start: int, stop: int, q: torch.Tensor) -> None:
    """Append tokens start..stop-1 and hand the layer the attention of the queries ``q`` (B, H, w, D)."""
    keys = onehot_keys(q.shape[0], start, stop)
    k, _ = layer.update(keys, keys.clone())
    layer.observe_attention(q, k, 1.0)


def kept(layer) -> list:
    """Original token ids kept, per row and head, ascending (the one-hot position of each stored key;
    H2O and TOVA may store them out of order after a decode step's in-place eviction)."""
    return layer.keys.argmax(-1).sort(dim=-1).values.tolist()


def test_snapkv_keeps_pooled_hits_and_the_window_per_head_and_row():
    layer = SnapKVPolicy(budget=7, observation_window=4, kernel_size=3, pooling="avg").layer(0, SPEC)
    q = queries([[{2: 10.0}, {9: 10.0}], [{5: 10.0}, {5: 10.0}]]).expand(-1, -1, 4, -1)
    step(layer, 0, 16, q)
    window = [12, 13, 14, 15]
    assert kept(layer) == [[[1, 2, 3, *window], [8, 9, 10, *window]], [[4, 5, 6, *window]] * 2]
    assert layer.keys.shape == (2, 2, 7, D) and layer.keys.untyped_storage().nbytes() == 2 * 2 * 7 * D * 4


def test_snapkv_without_pooling_takes_the_top_votes():
    layer = SnapKVPolicy(budget=6, observation_window=4, kernel_size=1).layer(0, SPEC)
    q = queries([[{2: 10.0, 7: 8.0, 8: 1.0}, {0: 9.0, 11: 9.5}]]).expand(-1, -1, 4, -1)
    step(layer, 0, 16, q)
    assert kept(layer) == [[[2, 7, 12, 13, 14, 15], [0, 11, 12, 13, 14, 15]]]


def test_h2o_accumulates_over_steps_and_protects_the_recent_window():
    layer = H2OPolicy(budget=5, recent=2, observation_window=2).layer(0, SPEC)
    prefill = queries([[{3: 9.0, 1: 7.0, 6: 5.0}, {0: 9.0, 4: 7.0, 5: 5.0}]]).expand(-1, -1, 2, -1)
    step(layer, 0, 10, prefill)  # heavy hitters of the last two prompt queries + tokens 8, 9
    assert kept(layer) == [[[1, 3, 6, 8, 9], [0, 4, 5, 8, 9]]]
    step(layer, 10, 11, queries([[{6: 12.0}, {8: 12.0}]]))
    # head 0: token 8 (lowest sum) goes although it is newer; head 1: token 8's new attention saves it
    assert kept(layer) == [[[1, 3, 6, 9, 10], [0, 4, 8, 9, 10]]]
    assert layer.acc.shape == (1, 2, 5)


def test_tova_drops_what_the_current_query_attends_to_least_averaged_over_heads():
    layer = TOVAPolicy(budget=4).layer(0, SPEC)
    step(layer, 0, 8, queries([[{2: 6.0, 5: 6.0, 7: 3.0}, {2: 6.0, 6: 6.0, 7: 3.0}]]))
    assert kept(layer) == [[[2, 5, 6, 7]] * 2]  # one choice for all heads: 5 and 6 each win on average
    step(layer, 8, 9, queries([[{5: 8.0, 2: 4.0, 6: 2.0, 8: 1.0}] * 2]))
    assert kept(layer) == [[[2, 5, 6, 8]] * 2]  # token 7 now gets the least attention
    assert layer.valid is None and layer.evicted == 5


def test_h2o_decode_drop_is_selects_choice_ties_included():
    """A decode step's one eviction (float32 scores, protected tokens masked) picks what ``select``'s float64
    priorities pick: the same positions stay at every step, with keys drawn from four vectors (many tied
    scores), past 128 tokens (where the eviction is in place)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(4, D, generator=gen)[torch.randint(0, 4, (1, 2, 200), generator=gen)]  # (1, 2, 200, D)
    qs = torch.randn(40, 1, 2, 1, D, generator=gen)
    runs, fast = {}, []
    for name in ("fast", "select"):
        layer = H2OPolicy(budget=150, recent=20, observation_window=2).layer(0, SPEC)
        if name == "select":
            layer._drop_lowest = lambda protected: False
        else:
            drop = layer._drop_lowest
            layer._drop_lowest = lambda protected, _f=drop: fast.append(_f(protected)) or fast[-1]
        k, _ = layer.update(keys[:, :, :160], keys[:, :, :160].clone())
        layer.observe_attention(qs[0].expand(-1, -1, 2, -1), k, 1.0)
        runs[name] = []
        for i, q in enumerate(qs):
            k, _ = layer.update(keys[:, :, 160 + i : 161 + i], keys[:, :, 160 + i : 161 + i].clone())
            layer.observe_attention(q, k, 1.0)
            runs[name].append(layer.pos.sort(dim=-1).values.tolist())
    assert runs["fast"] == runs["select"]
    assert len(fast) == 40 and all(fast)  # every decode step took the fast drop


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        (H2OPolicy, {"budget": 4, "compression_ratio": None, "recent": 8}, "h2o.budget=4 is below recent=8"),
        (TOVAPolicy, {"budget": 8, "compression_ratio": 0.5}, "exactly one of budget"),
    ],
)
def test_budgets_that_contradict_other_fields_are_refused_by_name(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
