"""R-KV against a float64 reference: the redundancy term, and the tokens a compression keeps (the window,
then the older tokens of best importance minus redundancy), at the prompt and when a generation outgrows
budget + slack."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcompress.core.policy import ModelSpec
from kvcompress.selectors.eviction.rkv import RKVPolicy, redundancy

D = 8
SPEC = ModelSpec(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=D, max_positions=128)


def reference_redundancy(key: torch.Tensor, threshold: float) -> torch.Tensor:
    """Float64, one key at a time: each key's similarity to its newest near-copy is dropped, then the
    softmax over tokens of each key's mean similarity to the others."""
    b, h, t, _ = key.shape
    out = torch.zeros(b, h, t, dtype=torch.float64)
    for r in range(b):
        for head in range(h):
            unit = key[r, head].double() / key[r, head].double().norm(dim=-1, keepdim=True)
            sim = unit @ unit.T
            sim.fill_diagonal_(0)
            for i in range(t):
                near = [j for j in range(t) if sim[i, j] > threshold]
                if near:
                    sim[i, max(near)] = 0
            out[r, head] = torch.softmax(sim.mean(0), dim=0)
    return out


def reference_keep(query, key, scaling, p, k) -> list:
    """Kept token indices (B, H_kv, k), sorted: the last ``w`` plus the older ones of best score."""
    b, h, t, _ = key.shape
    w, g = p.observation_window, query.shape[1] // h
    q = query[:, :, -w:].double().view(b, h, g, w, D)
    logits = torch.einsum("bhgwd,bhtd->bhgwt", q, key.double()) * scaling
    pos = torch.arange(t)
    qpos = t - w + torch.arange(w)
    logits = logits.masked_fill(pos[None, :] > qpos[:, None], float("-inf"))
    probs = torch.softmax(logits, -1).mean(2)[..., : t - w]  # (B, H_kv, w, T - w) group mean
    imp = (probs / probs.sum(-1, keepdim=True)).mean(2)
    imp = F.max_pool1d(imp, p.kernel_size, stride=1, padding=p.kernel_size // 2)
    red = reference_redundancy(key, p.similarity_threshold)[..., : t - w]
    score = p.mix_lambda * imp - (1 - p.mix_lambda) * red
    older = score.topk(k - w, dim=-1).indices
    window = torch.arange(t - w, t).expand(b, h, w)
    return torch.cat([older, window], -1).sort(-1).values.tolist()


def ids_of(stored: torch.Tensor, keys: torch.Tensor) -> list:
    same = (stored[:, :, :, None, :] == keys[:, :, None, :, :]).all(-1)  # (B, H, k, T)
    assert bool((same.sum(-1) == 1).all())
    return same.float().argmax(-1).sort(dim=-1).values.tolist()


def near_copies(g, b=1, h=2, t=24) -> torch.Tensor:
    """Keys (B, H, T, D) with runs of near-copies, so that the threshold matters."""
    base = torch.randn(b, h, -(-t // 3), D, generator=g).repeat_interleave(3, dim=2)[:, :, :t]
    return base + 0.1 * torch.randn(b, h, t, D, generator=g)


def test_redundancy_matches_the_float64_reference_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    key = near_copies(g, b=2, t=18)
    for threshold in (0.5, 0.9, 1.0):
        want = reference_redundancy(key, threshold)
        torch.testing.assert_close(redundancy(key, None, threshold).double(), want, atol=1e-6, rtol=0)
    valid = torch.ones(2, 1, 18, dtype=torch.bool)
    valid[1, 0, :6] = False  # row 1's first six slots are padding: it ranks as its last twelve alone
    got = redundancy(key, valid, 0.5)
    assert torch.equal(got[1, :, :6], torch.zeros(2, 6))
    torch.testing.assert_close(got[1, :, 6:], redundancy(key[1:, :, 6:], None, 0.5)[0], atol=1e-6, rtol=0)


def test_a_compression_keeps_the_window_and_the_older_tokens_of_best_score():
    g = torch.Generator().manual_seed(1)
    p = RKVPolicy(budget=12, compression_ratio=None, observation_window=4, kernel_size=3, slack=5)
    layer = p.layer(0, SPEC)
    keys = near_copies(g, t=40)
    query = torch.randn(1, 4, 24, D, generator=g)
    out, _ = layer.update(keys[:, :, :24], -keys[:, :, :24])
    layer.observe_attention(query, out, 0.5)
    assert ids_of(layer.keys, keys) == reference_keep(query, keys[:, :, :24], 0.5, p, 12)
    assert torch.equal(layer.values, -layer.keys)
    held, lengths = [layer.keys], []
    for t in range(24, 40):  # decode: appended until more than budget + slack, then compressed again
        q = torch.randn(1, 4, 1, D, generator=g)
        before = layer.keys
        out, _ = layer.update(keys[:, :, t : t + 1], -keys[:, :, t : t + 1])
        layer.observe_attention(q, out, 0.5)
        lengths.append(layer.stored_length())
        if lengths[-1] == 12 and t > 24:
            window = layer.queries  # the last four decode queries, which voted
            whole = torch.cat([before, keys[:, :, t : t + 1]], dim=2)
            kept = torch.tensor(reference_keep(window, whole, 0.5, p, 12))  # indices into `whole`
            want = whole.gather(2, kept[..., None].expand(-1, -1, -1, D))
            assert ids_of(layer.keys, keys) == ids_of(want, keys)
            held.append(layer.keys)
    assert lengths == [13, 14, 15, 16, 17, 12, 13, 14, 15, 16, 17, 12, 13, 14, 15, 16]
    assert len(held) == 3
