"""The Triton decode-attention kernels against dense references: on a GPU natively, on a CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, which ``conftest`` sets before triton is first imported). Shapes stay
small: the interpreter runs each program in numpy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvcompress.kernels import triton_attention as ta  # noqa: E402
from kvcompress.storage.quant import quantizer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def reference(query, key, value, scaling, valid=None):
    """Softmax attention of decode queries (B, H, 1, D) over key/value (B, H_kv, T, D) in float64; ``valid``
    (B or 1, 1 or H_kv, T). Returns the output (B, 1, H, D) and the probabilities per KV group
    (B, H_kv, 1, T)."""
    b, h, _, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    q = query.double().reshape(b, h_kv, h // h_kv, d)
    logits = q @ key.double().transpose(-1, -2) * scaling  # (B, H_kv, g, T)
    if valid is not None:
        logits = logits.masked_fill(~valid.expand(b, h_kv, t)[:, :, None], float("-inf"))
    probs = torch.softmax(logits, -1)
    out = (probs @ value.double()).reshape(b, 1, h, -1)
    return out, probs.mean(2, keepdim=True)


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def close(got, want, dtype, what):
    err = (got.double() - want.double()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.abs().max().item()), f"{what}: max error {err}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group,length", [(64, 1, 45), (128, 3, 77), (64, 8, 130)])
def test_dense_matches_reference_with_probabilities(dtype, head_dim, group, length):
    torch.manual_seed(0)
    b, h_kv = 2, 2
    q = randn(b, h_kv * group, 1, head_dim, dtype=dtype)
    k, v = randn(b, h_kv, length, head_dim, dtype=dtype), randn(b, h_kv, length, head_dim, dtype=dtype)
    out, probs = ta.dense(q, k, v, head_dim**-0.5, probs=True)
    want, want_p = reference(q, k, v, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == (b, 1, h_kv * group, head_dim)
    assert probs.dtype == torch.float32 and probs.shape == (b, h_kv, 1, length)
    close(out, want, dtype, "output")
    close(probs, want_p, torch.float32 if dtype == torch.float32 else torch.float16, "probabilities")
    assert torch.allclose(probs.sum(-1), torch.ones(b, h_kv, 1, device=DEVICE), atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_padded_rows_and_per_head_masks(dtype):
    """Left-padded rows attend only their real keys, and padding keys get probability exactly 0; a per-head
    mask (evictions that differ by head) is honoured head by head."""
    torch.manual_seed(1)
    b, h_kv, g, t, d = 2, 2, 3, 50, 64
    q = randn(b, h_kv * g, 1, d, dtype=dtype)
    k, v = randn(b, h_kv, t, d, dtype=dtype), randn(b, h_kv, t, d, dtype=dtype)
    rows = torch.ones(b, 1, t, dtype=torch.bool, device=DEVICE)
    rows[1, :, :17] = False  # row 1 left-padded by 17
    heads = torch.rand(b, h_kv, t, device=DEVICE) > 0.4
    heads[..., -1] = True
    for valid in (rows, heads):
        out, probs = ta.dense(q, k, v, d**-0.5, valid=valid, probs=True)
        want, want_p = reference(q, k, v, d**-0.5, valid)
        close(out, want, dtype, "output")
        assert (probs.expand(b, h_kv, 1, t)[~valid.expand(b, h_kv, t)[:, :, None]] == 0).all()
        close(probs, want_p, torch.float16 if dtype != torch.float32 else dtype, "probabilities")


def quantized(x, bits, group, axis, scale_dtype):
    """Codes of ``x`` (B, H, T, D) and their float32 reconstruction."""
    q = quantizer.quantize(x, bits, group, axis, scale_dtype)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return q, quantizer.dequantize(q, bits, group, axis, out)


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize(
    "dtype,head_dim,gqa,qgroup,axes",
    [
        (torch.float32, 64, 1, 32, ("channel", "token")),
        (torch.bfloat16, 128, 3, 64, ("channel", "token")),
        (torch.float16, 128, 8, 128, ("channel", "token")),
        (torch.bfloat16, 64, 3, 32, ("token", "token")),
        (torch.float32, 128, 1, 64, ("token", "channel")),
    ],
)
def test_kivi_from_codes_matches_dequantized_attention(bits, dtype, head_dim, gqa, qgroup, axes):
    """Attention straight from the packed codes (keys per channel or per token, values per token or per
    channel) plus the exact residual equals attention over the reconstruction and the residual."""
    torch.manual_seed(bits)
    b, h_kv, te, tr = 2, 2, 2 * qgroup, 13  # residual length not a multiple of the tile
    scale_dtype = torch.float16 if dtype == torch.float32 else dtype
    x_k, x_v = randn(b, h_kv, te, head_dim, dtype=dtype), randn(b, h_kv, te, head_dim, dtype=dtype)
    if "token" in axes and head_dim % qgroup:
        pytest.skip("group does not divide head_dim")
    kq, k_deq = quantized(x_k, bits, qgroup, axes[0], scale_dtype)
    vq, v_deq = quantized(x_v, bits, qgroup, axes[1], scale_dtype)
    k_res, v_res = randn(b, h_kv, tr, head_dim, dtype=dtype), randn(b, h_kv, tr, head_dim, dtype=dtype)
    q = randn(b, h_kv * gqa, 1, head_dim, dtype=dtype)
    out = ta.kivi(q, tuple(kq), tuple(vq), k_res, v_res, head_dim**-0.5, bits, qgroup,
                  key_channel=axes[0] == "channel", value_channel=axes[1] == "channel")  # fmt: skip
    keys, values = torch.cat([k_deq, k_res.float()], 2), torch.cat([v_deq, v_res.float()], 2)
    want, _ = reference(q, keys, values, head_dim**-0.5)
    assert out.dtype == dtype
    close(out, want, dtype, f"int{bits} {axes}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block,gqa,head_dim", [(16, 1, 64), (8, 3, 128), (16, 8, 64)])
def test_pages_read_in_place_match_gathered_attention(dtype, block, gqa, head_dim):
    """Pages chosen per KV head, the newest one partly stored: equal to attention over the gathered tokens."""
    torch.manual_seed(3)
    b, h_kv, n_pages, k_pages = 2, 2, 9, 4
    total = n_pages * block - 5  # the newest page holds block - 5 tokens
    k = randn(b, h_kv, n_pages * block, head_dim, dtype=dtype)
    v = randn(b, h_kv, n_pages * block, head_dim, dtype=dtype)
    pages = torch.stack([torch.randperm(n_pages - 1, device=DEVICE)[: k_pages - 1] for _ in range(b * h_kv)])
    pages = torch.cat([pages.sort(-1).values, torch.full((b * h_kv, 1), n_pages - 1, device=DEVICE)], -1)
    pages = pages.view(b, h_kv, k_pages)
    pages[1, 0, 0] = -1  # an unused slot (a row with fewer pages to read) is skipped
    q = randn(b, h_kv * gqa, 1, head_dim, dtype=dtype)
    out = ta.pages_attention(q, k, v, pages, block, total, head_dim**-0.5)
    slots = (pages[..., None] * block + torch.arange(block, device=DEVICE)).flatten(2)  # (B, H_kv, k * block)
    valid = (slots < total) & (slots >= 0)
    idx = slots.clamp(0, total - 1)[..., None].expand(-1, -1, -1, head_dim)
    want, _ = reference(q, k.gather(2, idx), v.gather(2, idx), head_dim**-0.5, valid)
    close(out, want, dtype, "pages")


def test_long_sequences_split_and_combine():
    """A sequence long enough for several splits per head gives the single-pass answer."""
    torch.manual_seed(4)
    b, h_kv, g, t, d = 1, 1, 2, 1000, 64
    q = randn(b, h_kv * g, 1, d, dtype=torch.float32)
    k, v = randn(b, h_kv, t, d, dtype=torch.float32), randn(b, h_kv, t, d, dtype=torch.float32)
    acc, _, _ = ta.dense_partials(q, k, v, d**-0.5)
    assert acc.shape[2] > 1  # really split
    out, probs = ta.dense(q, k, v, d**-0.5, probs=True)
    want, want_p = reference(q, k, v, d**-0.5)
    close(out, want, torch.float32, "split output")
    close(probs, want_p, torch.float32, "split probabilities")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa,window", [(1, 1), (3, 8), (8, 5)])
def test_window_scores_match_the_reference_form(dtype, gqa, window):
    """The prefill score window (the last ``w`` queries over every key, causal within the window, padding
    keys and padding queries 0), from one pass over the keys in their own dtype."""
    from kvcompress.core import torch_attention

    torch.manual_seed(6)
    b, h_kv, t, d = 2, 2, 70, 64
    q = randn(b, h_kv * gqa, window, d, dtype=dtype)
    k = randn(b, h_kv, t, d, dtype=dtype)
    valid = torch.ones(b, 1, t, dtype=torch.bool, device=DEVICE)
    valid[1, :, :30] = False  # row 1 left-padded
    for v in (None, valid):
        got = ta.window_scores(q, k, d**-0.5, v)
        saved = list(torch_attention.WINDOW_SCORERS)
        torch_attention.WINDOW_SCORERS.clear()  # the tensor form, in float32
        try:
            want = torch_attention.window_scores(q.float(), k.float(), d**-0.5, v)
        finally:
            torch_attention.WINDOW_SCORERS[:] = saved
        assert got.shape == want.shape == (b, h_kv, window, t) and got.dtype == torch.float32
        close(got, want, torch.float16 if dtype != torch.float32 else dtype, f"window {window}")
