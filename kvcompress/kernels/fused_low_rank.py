"""Decode attention in the low-rank latent space: no reconstructed copy of the values, nor of post-RoPE keys.

A block of ``g`` KV heads caches one latent ``c_t`` (R components) per token and reconstructs head ``i`` of
the block as ``dec_i c_t`` (``dec_i``: the decoder's rows of that head, (D, R)). For a query head ``h`` of
KV head ``i``:

- values (any key mode): ``sum_t p_ht (dec_i c_t) = dec_i (sum_t p_ht c_t)``: the probabilities attend over
  the (T, R) latents, and the decoder projects the result once (R x D per query head, not per token);
- post-RoPE keys (and pre-RoPE keys on a layer without RoPE): ``q_h . (dec_i c_t) = (dec_i^T q_h) . c_t``:
  the decoder folds into the query, and the logits are one (R)-wide dot product per token;
- pre-RoPE keys: RoPE rotates each key by its own position, so ``dec_i`` cannot fold into one query. The
  keys are reconstructed (one (T, R) x (R, g D) product) and rotated, but only they: the values stay latent.
  On a CPU the C++ kernel ``kernels/rope_latent.cpp`` (``rope_logits``) rebuilds a few keys at a time in
  registers, rotates them with the shared cos/sin table (``storage/rope_table.py``) and dots them with the
  GQA group's queries: no (T, D) copy is written. Elsewhere, or for a rotation the kernel does not pair
  alike, the keys are rebuilt with tensors and rotated by the model's own module.

With int8 coefficients the per-token scales fold into the logits and into the probabilities. The exact
residual window joins the same float32 softmax. Exact up to float rounding (the reconstruct-then-SDPA path
rounds reconstructed tokens to the model dtype first). Palu (arXiv 2407.21118) folds the value decoder into
the output projection offline; here both maps stay in the cache, so any model works unchanged.

A store hands its latents to attention as data (``kvcompress.core.plan.Latent``); the ``torch`` backend
(``kvcompress.kernels.backends``) runs ``attend`` on them.
"""

from __future__ import annotations

from functools import partial

import torch

from kvcompress import kernels
from kvcompress.core.latents import rebuild
from kvcompress.core.plan import Latent
from kvcompress.core.profiling import TIMER
from kvcompress.core.torch_attention import attend_by_parts


def attend(query: torch.Tensor, scaling: float, read: Latent) -> torch.Tensor:
    """Output (B, 1, H, D) of decode queries (B, H, 1, D) over a ``Latent`` read: the softmax (float32) of
    the logits over its keys, then the probabilities' sum of its values."""
    logits, values = partial(key_logits, read), partial(value_output, read)
    return attend_by_parts(query, scaling, read.kv_heads, logits, values)


def key_logits(read: Latent, q: torch.Tensor) -> torch.Tensor:
    """Logits (B, G, g * n, T) of scaled queries q (B, H_kv, n, D) float32 over every key of ``read``."""
    parts, dec = read.keys, read.key_decoder
    # the decoder folds into the query, unless each key turns by its own position (pre-RoPE: rebuilt)
    encoded = latent_logits(fold_query(q, dec), parts) if read.rope is None else _rope_logits(read, q)
    return torch.cat([encoded, residual_logits(q, read.key_res, dec.shape[0])], dim=-1)


def _rope_logits(read: Latent, q: torch.Tensor) -> torch.Tensor:
    """Logits over the encoded pre-RoPE keys: rebuilt and rotated inside the C++ kernel where it serves
    (counted as attention, as the quant kernel's unpacking is), else rebuilt by tensors and rotated by the
    layer's ``rope`` (counted as policy overhead)."""
    parts, dec, positions = read.keys, read.key_decoder, read.positions  # positions (B, H_kv, Te)
    (b, h, te), blocks = positions.shape, dec.shape[0]
    block_positions = positions.view(b, blocks, h // blocks, te)[:, :, 0]  # a block's heads share them
    logits = rope_logits(q, parts, dec, block_positions, read.rope, read.seen)
    if logits is not None:
        if read.counts is not None:
            read.counts["rope_kernel_steps"] += 1
        return logits
    with TIMER.measure():
        keys = read.rope.rotate(rebuild(parts, dec, h), block_positions)  # (B, H_kv, Te, D) float32
    return residual_logits(q, keys, blocks)


def value_output(read: Latent, probs: torch.Tensor) -> torch.Tensor:
    """``sum_t p_ht v_t`` (B, H_kv, n, D) float32 for probs (B, G, g * n, T): the encoded tokens' in the
    latent space, then the residual window's (every value, where ``read`` holds them dense)."""
    if read.values is None:
        return dense_values(probs, read.value_res)
    te = read.values[0].shape[2]
    n = probs.shape[2] * probs.shape[1] // read.value_res.shape[1]
    out = latent_values(probs[..., :te], read.values, read.value_decoder, n)
    return out + dense_values(probs[..., te:], read.value_res)


def _latent(parts: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Coefficients (B, G, T, R) as float32, and their int8 scale (B, G, T, 1) or None for float ones."""
    return parts[0].float(), (parts[1].float() if len(parts) > 1 else None)


def fold_query(q: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
    """``dec_i^T q_h`` for every query head: q (B, H_kv, n, D) float32, decoder (G, g * D, R) ->
    (B, G, g * n, R), rows ordered as the heads (KV head, then its n query heads)."""
    b, h_kv, n, d = q.shape
    blocks, _, r = decoder.shape
    g = h_kv // blocks
    folded = q.view(b, blocks, g, n, d) @ decoder.view(blocks, g, d, r)  # (B, G, g, n, R)
    return folded.view(b, blocks, g * n, r)


def latent_logits(q_lat: torch.Tensor, parts: tuple) -> torch.Tensor:
    """``q_lat . c_t`` for every encoded token: q_lat (B, G, m, R); parts as stored -> (B, G, m, Tc)."""
    coef, scale = _latent(parts)
    logits = q_lat @ coef.mT
    return logits if scale is None else logits * scale.mT


def latent_values(probs: torch.Tensor, parts: tuple, decoder: torch.Tensor, n: int) -> torch.Tensor:
    """``dec_i (sum_t p_ht c_t)``: probs (B, G, g * n, Tc) float32 over the encoded tokens; decoder
    (G, g * D, R) -> (B, H_kv, n, D) float32."""
    coef, scale = _latent(parts)
    mixed = mix(probs if scale is None else probs * scale.mT, coef)  # (B, G, g * n, R)
    b, blocks = mixed.shape[:2]
    gd, r = decoder.shape[1:]
    g = mixed.shape[2] // n
    d = gd // g
    out = mixed.view(b, blocks, g, n, r) @ decoder.view(blocks, g, d, r).mT  # (B, G, g, n, D)
    return out.view(b, blocks * g, n, d)


def mix(probs: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``probs @ coef``: probs (B, G, m, T), coef (B, G, T, R) float32 -> (B, G, m, R). On a CPU by the C++
    kernel ``kernels/latent_values.cpp`` where it serves (a BLAS takes about four times as long as reading
    the latents for so few rows), else by ``matmul``."""
    if probs.device.type == "cpu" and probs.dtype == coef.dtype == torch.float32:
        kernel = kernels.load("latent_values")
        if kernel is not None and probs.stride(-1) == 1 and coef.stride(-1) == 1:
            return kernel.latent_mix(probs, coef)
    return probs @ coef


def residual_logits(q: torch.Tensor, keys: torch.Tensor, blocks: int) -> torch.Tensor:
    """Logits (B, G, g * n, T) of q (B, H_kv, n, D) over dense keys (B, H_kv, T, D), in the block layout."""
    logits = q @ keys.float().mT  # (B, H_kv, n, T)
    b, h_kv, n, t = logits.shape
    return logits.view(b, blocks, h_kv // blocks * n, t)


def dense_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_t p_ht v_t``: probs (B, G, g * n, T) float32, values (B, H_kv, T, D) -> (B, H_kv, n, D)."""
    b, blocks, m, t = probs.shape
    h_kv = values.shape[1]
    return probs.reshape(b, h_kv, blocks * m // h_kv, t) @ values.float()


def rope_logits(q: torch.Tensor, parts: tuple, decoder, positions, rope, seen: int):
    """Logits (B, G, g * n, Te) of scaled queries q (B, H_kv, n, D) float32 over pre-RoPE latents ``parts``
    rotated at ``positions`` (B, G, Te) int32 (``seen``: tokens appended so far, the table's first length),
    by the C++ kernel; None where it cannot serve (not a CPU, not built, another pairing: rebuild instead)."""
    if q.device.type != "cpu" or not rope.fits_kernel(q.shape[-1]):
        return None
    kernel = kernels.load("rope_latent")
    if kernel is None:
        return None
    coef, scale = _latent(parts)
    dect = decoder.mT.contiguous()  # (G, R, g * D): the store lays its key decoder out so (no copy)
    q = q.contiguous()
    logits = kernel.rope_logits(q, coef, dect, positions, *rope.table.covering(max(seen, 1)))
    if logits is None and positions.numel() and int(positions.min()) >= 0:  # a position past the tokens
        top = int(positions.max()) + 1  # seen (given by the caller): a longer table serves it
        logits = kernel.rope_logits(q, coef, dect, positions, *rope.table.covering(top))
    if logits is None:  # a negative position has no table row
        return None
    return logits if scale is None else logits * scale.mT


def turn_keys(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Keys x (B, H_kv, n, D) turned at ``positions`` (B, h, n) by a cos/sin table's rows (P, rotary / 2), in
    float32, by the C++ kernel (``rope_latent.turn_keys``: the bits of ``rope_table.rotate_halves``, one call
    instead of a dozen tensor ops); None where it is not built or a position is past the table. Lent to
    ``storage.rope`` through ``kvcompress.core.kernel_slots``."""
    kernel = kernels.load("rope_latent")
    if kernel is None:
        return None
    return kernel.turn_keys(x.float().contiguous(), positions.to(torch.int32).contiguous(), cos, sin)
