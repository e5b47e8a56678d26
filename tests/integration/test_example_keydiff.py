"""The KeyDiff example plugin (``tests/plugins/example_keydiff.py``, shown in docs/extending.md) keeps in a
left-padded batch the tokens each row keeps alone, and the same selector with its mean taken over every
stored slot, padding included, does not: the padding it reads shifts a padded row's ranking."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from conftest import make_tiny
from example_keydiff import KeyDiffLayer, KeyDiffPolicy

from kvcompress import build_cache
from kvcompress.runtime.padding import Padded, left_pad

G = torch.Generator().manual_seed(3)
ROWS = [torch.randint(2, 95, (1, n), generator=G) for n in (30, 22)]  # row 1 gets 8 padding slots


class Tracked(KeyDiffLayer):
    needs_positions = True  # record each stored token's slot, to compare what the rows keep


class NaiveLayer(Tracked):
    """The documented selector with the mean over all stored slots: a padded row's padding counts."""

    def observe_attention(self, query, key, scaling: float, probs=None) -> None:
        k = self.target()
        if self.stored_length() > k:
            unit = F.normalize(key.float(), dim=-1)  # (B, H_kv, T, D)
            anchor = unit.mean(-2, keepdim=True)  # padding slots included
            self.select(-F.cosine_similarity(unit, anchor, dim=-1), k)


@dataclasses.dataclass
class TrackedPolicy(KeyDiffPolicy):
    layer_class = Tracked


@dataclasses.dataclass
class NaivePolicy(KeyDiffPolicy):
    layer_class = NaiveLayer


@torch.inference_mode()
def _kept(model, policy_class, rows) -> list[list[torch.Tensor]]:
    """Per layer, per row: the sorted positions in the row's own tokens (H_kv, k) that the cache keeps after
    the prompt."""
    ids, mask = left_pad(rows)
    cache = build_cache(policy_class(budget=12, compression_ratio=None), model)
    Padded(model, cache, mask).prompt(ids)
    pad = [ids.shape[1] - r.shape[1] for r in rows]
    return [
        [(layer.positions()[b] - pad[b]).sort(-1).values for b in range(len(rows))] for layer in cache.layers
    ]


def _rows_kept_as_alone(model, policy_class) -> list[bool]:
    """For each row: whether every layer keeps in the padded batch what it keeps for the row alone."""
    batched = _kept(model, policy_class, ROWS)
    alone = [_kept(model, policy_class, [row]) for row in ROWS]
    return [
        all(torch.equal(layer[b], by_row[i][0]) for i, layer in enumerate(batched))
        for b, by_row in enumerate(alone)
    ]


def test_the_documented_keydiff_keeps_each_padded_row_as_alone_and_the_naive_mean_does_not():
    model = make_tiny("llama")
    assert _rows_kept_as_alone(model, TrackedPolicy) == [True, True]
    assert _rows_kept_as_alone(model, NaivePolicy) == [True, False]  # only the padded row reads padding
