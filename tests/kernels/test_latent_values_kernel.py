"""The C++ mix of low-rank latents by the probabilities (``kernels/latent_values.cpp``) against ``matmul``, in
both builds (``kernel_isa``): every register tile (R = 16, 32, 64 + 32), GQA rows of 1 to 9, token counts off
the span, views into growable buffers, and components off the register width (the portable loop)."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_or_skip

from kvcompress import kernels
from kvcompress.kernels import fused_low_rank


@pytest.fixture
def _needs_kernel():  # at test time, not collection: the kernels build in the background meanwhile
    kernel_or_skip("latent_values")


pytestmark = [
    pytest.mark.usefixtures("kernel_isa", "_needs_kernel"),
]


def _inputs(b, g, m, t, r, seed=0):
    gen = torch.Generator().manual_seed(seed)
    coef = torch.randn(b, g, t + 11, r, generator=gen)[:, :, :t]  # a growable buffer's leading slice
    probs = torch.softmax(torch.randn(b, g, m, t + 1, generator=gen), -1)[..., :t]  # encoded tokens' columns
    return probs, coef


@pytest.mark.parametrize(
    "b,g,m,t,r",
    [
        (1, 3, 3, 4096, 32),
        (2, 1, 9, 301, 96),
        (1, 3, 3, 77, 16),
        (2, 2, 5, 65, 48),
        (1, 1, 1, 1, 16),
        (1, 2, 3, 50, 40),
        (2, 1, 2, 9, 5),
    ],
    ids=["head-r32-4k", "joint-r96", "r16-odd-t", "rows5-r48", "one-token", "r40-off-width", "r5"],
)
def test_kernel_equals_matmul(b, g, m, t, r):
    probs, coef = _inputs(b, g, m, t, r)
    got = kernels.load("latent_values").latent_mix(probs, coef)
    assert got.shape == (b, g, m, r)
    torch.testing.assert_close(got, probs @ coef, rtol=1e-5, atol=1e-6)
    assert torch.equal(fused_low_rank.mix(probs, coef), got)  # the decode path takes the kernel


def test_bad_layouts_are_refused_by_name():
    probs, coef = _inputs(1, 1, 2, 20, 16)
    with pytest.raises(RuntimeError, match="coef: expected"):
        kernels.load("latent_values").latent_mix(probs, coef.mT.contiguous().mT)
    with pytest.raises(RuntimeError, match="probs: expected"):
        kernels.load("latent_values").latent_mix(probs.double(), coef)
