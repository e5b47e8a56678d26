"""``batch_repeat_interleave`` and ``batch_select_indices`` (what ``num_return_sequences`` and contrastive
search call): every registered policy, at its small test parameters, continues each copied or kept row
exactly as that row continues alone; a storage that cannot change its batch says so by name."""

from __future__ import annotations

import pytest
import torch
from conftest import POLICY_NAMES, small

from kvcompress import build_cache

IDS = torch.randint(2, 95, (2, 46), generator=torch.Generator().manual_seed(9))  # two different rows


@torch.inference_mode()
def _run(model, cache, prompt: torch.Tensor | None, steps: torch.Tensor) -> torch.Tensor:
    """Logits (B, n, V) of one-token steps feeding ``steps`` (B, n), after ``prompt`` in one forward."""
    if prompt is not None:
        model(prompt, cache=cache)
    return torch.cat([model(steps[:, i : i + 1], cache=cache).logits for i in range(steps.shape[1])], 1)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_copied_and_selected_rows_continue_as_each_row_alone(llama, name):
    alone = []
    for row in range(2):  # each row on its own: 3 steps, then 3 more
        cache = build_cache(small(name), llama)
        alone.append(_run(llama, cache, IDS[row : row + 1, :40], IDS[row : row + 1, 40:])[0])
    cache = build_cache(small(name), llama)
    with torch.inference_mode():
        llama(IDS[:, :40], cache=cache)
    try:
        cache.batch_repeat_interleave(2)  # rows a, a, b, b
    except ValueError as err:
        assert "batch cannot change size" in str(err) and name in str(err)
        return
    got = _run(llama, cache, None, IDS[:, 40:43].repeat_interleave(2, 0))
    for row in range(4):
        torch.testing.assert_close(got[row], alone[row // 2][:3], atol=1e-5, rtol=1e-5)
    cache.batch_select_indices(torch.tensor([3, 0]))  # rows b, a
    got = _run(llama, cache, None, IDS[[1, 0], 43:])
    torch.testing.assert_close(got[0], alone[1][3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], alone[0][3:], atol=1e-5, rtol=1e-5)
