"""Left-padded batches (``kvcompress.runtime.padding``): every selector x storage cell either compresses each
padded
row exactly as it compresses the row alone (prompt, question fed token by token, greedy steps), or declares
``pads_exactly = False`` and is refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import CELLS, IDS, cell_policy, make_tiny
from helpers import refuses_padding

from kvcompress import build_cache
from kvcompress.runtime.padding import Padded, left_pad

G = torch.Generator().manual_seed(3)
ROWS = [torch.randint(2, 95, (1, n), generator=G) for n in (30, 27, 22)]
TAIL = torch.randint(2, 95, (1, 4), generator=G)  # the question: same length in every row


@torch.inference_mode()
def _logits(model, policy, rows):
    """Logits (B, 1 + tail + 3, V): the prompt's last position, each tail token, three greedy steps."""
    ids, mask = left_pad(rows)
    stream = Padded(model, build_cache(policy, model), mask)
    out = [stream.prompt(ids)]
    for i in range(TAIL.shape[1]):
        out.append(stream.step(TAIL[:, i : i + 1].expand(len(rows), 1)))
    for _ in range(3):
        out.append(stream.step(out[-1][:, -1].argmax(-1, keepdim=True)))
    return torch.cat(out, 1)


RUN = [(c, i) for c, i in zip(CELLS, IDS, strict=True) if cell_policy(*c).refusal() is None]


@pytest.mark.parametrize("sel,var", [c for c, _ in RUN], ids=[i for _, i in RUN])
def test_padded_rows_compress_as_alone_or_are_refused_by_name(sel, var):
    model = make_tiny("llama")
    policy = cell_policy(sel, var)
    if refuses_padding(build_cache(policy, model), policy.name):
        return
    batched = _logits(model, policy, ROWS)
    for b, row in enumerate(ROWS):
        torch.testing.assert_close(batched[b : b + 1], _logits(model, policy, [row]), atol=2e-5, rtol=1e-4)
