"""RoPE as selectors need it: the model's per-layer frequencies, rotations of post-RoPE vectors by a number
of positions, and the mean rotation over the next positions (Su et al., "RoFormer", arXiv 2104.09864).

Layout is transformers' rotate-half: dimension ``i`` and ``i + D/2`` form a pair turning at ``inv_freq[i]``.
"""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``x`` (..., D) turned by ``angles`` (..., D/2) radians per pair (broadcast)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mean_rotation(inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """The (D, D) average of the rotations by 1..``positions`` positions (a scaled rotation per pair)."""
    j = torch.arange(1, positions + 1, device=inv_freq.device, dtype=torch.float64)[:, None]
    angles = j * inv_freq.double()  # (n, D/2)
    c, s = angles.cos().mean(0), angles.sin().mean(0)
    top = torch.cat([torch.diag(c), -torch.diag(s)], dim=1)
    bottom = torch.cat([torch.diag(s), torch.diag(c)], dim=1)
    return torch.cat([top, bottom], dim=0).float()


def rope_frequencies(model) -> list[torch.Tensor]:
    """Each decoder layer's RoPE ``inv_freq`` (D/2,) float32 on CPU (per layer type when the model has
    several, as Gemma 3's local and global layers). Refuses models whose RoPE does not turn the whole head."""
    cfg = model.config.get_text_config(decoder=True)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    rotary = getattr(decoder, "rotary_emb", None)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    types = getattr(cfg, "layer_types", None) or [None] * cfg.num_hidden_layers
    out = []
    for kind in types:
        inv = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
        inv = getattr(rotary, "inv_freq", None) if inv is None else inv
        if not isinstance(inv, torch.Tensor) or inv.numel() * 2 != head_dim:
            raise ValueError(
                f"model {getattr(cfg, 'model_type', '?')!r}: RoPE must turn the whole head (rotate-half, "
                f"inv_freq of head_dim/2={head_dim // 2} frequencies on the decoder's rotary_emb); found "
                f"{None if inv is None else tuple(inv.shape)}"
            )
        out.append(inv.detach().float().cpu().clone())
    return out
