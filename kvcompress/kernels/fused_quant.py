"""Decode attention straight from KIVI's packed codes: no dequantized copy of the cache is ever made.

Keys are quantized per channel (``G`` tokens share a scale ``s`` and zero ``z`` per channel), values per
token (``G`` channels of a token share them). With ``k_td = z_nd + s_nd c_td`` (``n = t // G``) a query's
logit is ``q . k_t = sum_d (q_d s_nd) c_td + sum_d q_d z_nd``: the key scales fold into one scaled query
per token group, the zero points into one constant per group. With ``v_td = z_tj + s_tj c_td``
(``j = d // G``) the output is ``sum_t (p_t s_tj) c_td + sum_t p_t z_tj``: the value scales fold into the
probabilities. Both sums run bit plane by bit plane over the packed bytes (``quantizer.pack``'s block
layout), then the residual window (full precision) joins the same softmax.

The sums are written as plain tensor code: ``torch.compile`` fuses unpacking, scaling and reduction into
one loop over the bytes (C++/OpenMP on CPU, Triton on GPU), compiled once for every length (dynamic
shapes). Where compile is unavailable the eager form runs the same sums through ``matmul`` (no
broadcast temporaries); the two agree to float32 rounding. On a CPU, a hand-written kernel
(``kvcompress.kernels``, ``quant.backend: cpu``, what ``auto`` picks there when it builds) runs the
same sums in blocks of 16 tokens from the bytes (the forms' speeds: experiments/fused/README.md). Which
backend runs is ``quant.backend`` and the attention backends' choice (``kvcompress.kernels.backends``:
``cpu`` for the kernel, ``torch`` for the tensor forms, which picks its form in ``tensor_attention``).
Liu et al., KIVI, arXiv 2402.02750.
"""

from __future__ import annotations

import os
import warnings

import torch

from kvcompress import kernels

IMPLS = ("matmul", "fused", "kernel")  # eager tensor form, the form torch.compile fuses, the C++ kernel
COMPILE_MIN_TOKENS = 1024  # "auto": below this a compiled call's fixed cost outweighs its gain
_COMPILED: dict[str, object] = {}  # "fn" -> the compiled attention, or None once compile failed
_LOADED: dict[str, object] = {}  # $KVCOMPRESS_CPU_ISA -> the built quant_attention module (``_module``)


def _plane(codes: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Codes of channel block ``k`` (..., W) as float32, from packed bytes (..., W)."""
    per, mask = 8 // bits, (1 << bits) - 1
    x = codes >> (bits * k) if k else codes
    return (x & mask if k < per - 1 else x).float()


def key_logits(q, codes, scale, zero, bits: int, group: int, fused: bool) -> torch.Tensor:
    """``q . k_t`` for every quantized key: q (B, H_kv, g, D) float32; codes (B, H_kv, Te, D * bits / 8);
    scale, zero (B, H_kv, Te / G, D). Returns (B, H_kv, g, Te) float32."""
    b, h, g, d = q.shape
    te, per = codes.shape[2], 8 // bits
    n, w = te // group, d // per
    qs = q[:, :, :, None, :] * scale.float()[:, :, None]  # (B, H_kv, g, Te/G, D): scales folded in
    out = torch.matmul(zero.float()[:, :, None], q[..., None])  # (B, H_kv, g, Te/G, 1): the zero points
    for k in range(per):
        qk = qs[..., k * w : (k + 1) * w]  # (B, H_kv, g, Te/G, W)
        c = _plane(codes, bits, k).view(b, h, 1, n, group, w)
        if fused:  # one reduction over the bytes (token-major output, so it vectorises over tokens)
            out = out + (c.transpose(-1, -2) * qk[..., None]).sum(-2)
        else:  # (B, H_kv, Te/G, G, W) @ (B, H_kv, Te/G, W, g)
            out = out + torch.matmul(c[:, :, 0], qk.permute(0, 1, 3, 4, 2)).permute(0, 1, 4, 2, 3)
    return out.reshape(b, h, g, te)


def value_output(p, codes, scale, zero, bits: int, group: int, fused: bool) -> torch.Tensor:
    """``sum_t p_t v_t`` over the quantized values: p (B, H_kv, g, Te) float32; codes (B, H_kv, Te,
    D * bits / 8); scale, zero (B, H_kv, Te, D / G). Returns (B, H_kv, g, D) float32."""
    b, h, g, te = p.shape
    per = 8 // bits
    d = codes.shape[-1] * per
    w = d // per
    ps = p[..., None] * scale.float()[:, :, None]  # (B, H_kv, g, Te, D/G): scales folded into p
    blocks = []
    for k in range(per):
        c = _plane(codes, bits, k)  # (B, H_kv, Te, W)
        first, m = k * w // group, max(1, w // group)  # groups of this block, G channels (or W) each
        pk = ps[..., first : first + m]  # (B, H_kv, g, Te, m)
        cg = c.view(b, h, te, m, w // m)
        if fused:
            blocks.append((pk[..., None] * cg[:, :, None]).sum(3).reshape(b, h, g, w))
        else:  # (B, H_kv, m, g, Te) @ (B, H_kv, m, Te, W/m)
            part = torch.matmul(pk.permute(0, 1, 4, 2, 3), cg.permute(0, 1, 3, 2, 4))
            blocks.append(part.permute(0, 1, 3, 2, 4).reshape(b, h, g, w))
    zeros = torch.matmul(p, zero.float())  # (B, H_kv, g, D/G)
    return torch.cat(blocks, -1) + zeros.repeat_interleave(group, -1)


def key_logits_token(q, codes, scale, zero, bits: int, group: int, fused: bool) -> torch.Tensor:
    """``q . k_t`` for keys quantized per token (``G`` channels of a token share a scale and zero):
    ``sum_j s_tj (q_j . c_tj) + sum_j z_tj sum(q_j)``. q (B, H_kv, g, D) float32; codes (B, H_kv, Te,
    D * bits / 8); scale, zero (B, H_kv, Te, D / G). Returns (B, H_kv, g, Te) float32. The tensor form unpacks
    the codes (a (Te, D) float temporary, as a dequantized read); the C++ kernel reads them in place."""
    b, h, g, d = q.shape
    te, per, ng = codes.shape[2], 8 // bits, d // group
    c = torch.cat([_plane(codes, bits, k) for k in range(per)], -1)  # (B, H_kv, Te, D)
    qg = q.view(b, h, g, ng, group).transpose(2, 3)  # (B, H_kv, ng, g, G)
    dots = torch.matmul(qg, c.view(b, h, te, ng, group).permute(0, 1, 3, 4, 2))  # (B, H_kv, ng, g, Te)
    scaled = (dots * scale.float().permute(0, 1, 3, 2)[:, :, :, None]).sum(2)  # (B, H_kv, g, Te)
    return scaled + torch.matmul(qg.sum(-1).transpose(2, 3), zero.float().transpose(-1, -2))


def attend(query, kq, vq, k_res, v_res, scaling: float, bits: int, group: int, impl: str) -> torch.Tensor:
    """One decode query over KIVI's codes (keys per channel) then the residual window: ``attend_scored``'s
    output (B, 1, H, D) alone, the form ``torch.compile`` fuses."""
    return attend_scored(query, kq, vq, k_res, v_res, scaling, bits, group, impl)[0]


def attend_scored(query, kq, vq, k_res, v_res, scaling, bits, group, impl, key_axis="channel", scores=False):
    """One decode query over quantized tokens then the residual window, softmax in float32.

    Args:
        query: (B, H, 1, D). kq: key codes, scales, zeros (per channel, or per token with
            ``key_axis="token"``); vq: value ones (per token).
        k_res, v_res: (B, H_kv, Tr, D) the full-precision window, after the quantized tokens.
        impl: ``IMPLS``: ``matmul`` (eager), ``fused`` (for ``torch.compile``), ``kernel`` (C++, CPU).
        scores: return the probabilities too, averaged over each KV group's query heads (what score-based
            eviction reads, as ``torch_attention.decode_attention`` returns them).

    Returns:
        (B, 1, H, D) in the query's dtype, as the models' attention functions return it, and the
        probabilities (B, H_kv, 1, Te + Tr) float32 in stored order, or None.
    """
    b, h, _, d = query.shape
    h_kv = k_res.shape[1]
    q = query.reshape(b, h_kv, h // h_kv, d).float() * scaling  # (B, H_kv, g, D)
    name = "key_logits" if key_axis == "channel" else "key_logits_token"
    built = built_module() if impl == "kernel" else None
    logits_q = sums(impl, name, q, kq, bits, group, built)  # (B, H_kv, g, Te)
    logits_r = torch.matmul(q, k_res.float().transpose(-1, -2))  # (B, H_kv, g, Tr)
    probs = torch.softmax(torch.cat([logits_q, logits_r], -1), -1)
    te = logits_q.shape[-1]
    out = sums(impl, "value_output", probs[..., :te], vq, bits, group, built)
    out = out + torch.matmul(probs[..., te:], v_res.float())  # (B, H_kv, g, D)
    out = out.reshape(b, 1, h, d).to(query.dtype)
    return out, probs.mean(dim=2, keepdim=True) if scores else None


def plan_attention(plan, call):
    """``attend_scored`` through the C++ kernel for a KIVI read (``core.plan.Kivi``), with the probabilities
    where the plan asks for them: the ``cpu`` backend's kernel for such plans (``Backend.kernel``)."""
    r = plan.read
    args = (r.keys, r.values, r.key_res, r.value_res, call.scaling, r.bits, r.group, "kernel", r.key_axis)
    return attend_scored(call.query, *args, plan.probs == "last")


def built_module():
    """The built ``quant_attention`` module of the build ``$KVCOMPRESS_CPU_ISA`` names, loaded once per
    value (``kernels.load``): a decode step reads one dict entry."""
    isa = os.environ.get(kernels.ISA_ENV, "")
    built = _LOADED.get(isa)
    if built is None:
        built = _LOADED[isa] = kernels.load()
    return built


def sums(impl: str, name: str, x, parts, bits: int, group: int, built=None) -> torch.Tensor:
    """``key_logits`` (or ``key_logits_token``) or ``value_output`` of ``x`` over quantized ``parts`` in the
    form ``impl`` says; ``built``: the loaded C++ module for ``kernel``, when the caller has it already."""
    if impl == "kernel":
        codes, scale, zero = parts
        args = (x.contiguous(), codes.contiguous(), scale.float().contiguous(), zero.float().contiguous())
        return getattr(built or kernels.load(), name)(*args, bits, group)
    return globals()[name](x, *parts, bits, group, impl == "fused")


def _compiled():
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(attend, dynamic=True)
    return _COMPILED["fn"]


def tensor_attention(mode: str, query, kq, vq, k_res, v_res, scaling, bits: int, group: int):
    """``attend`` in a tensor form: compiled for ``compile`` (and for ``auto`` from ``COMPILE_MIN_TOKENS``
    quantized tokens), else the eager ``matmul`` form. A failed compile under ``auto`` falls back to the
    eager form, said once; under ``compile`` it raises."""
    args = (query, kq, vq, k_res, v_res, scaling, bits, group)
    want = mode == "compile" or (mode == "auto" and kq[0].shape[2] >= COMPILE_MIN_TOKENS)
    if want and _COMPILED.get("fn", True) is not None:
        try:
            return _compiled()(*args, "fused")
        except Exception as err:  # no C++ compiler / Triton here: the eager form, said once
            if mode == "compile":
                raise
            _COMPILED["fn"] = None
            msg = f"quant fused attention: torch.compile unavailable ({err!r:.200}); eager form used"
            warnings.warn(msg, stacklevel=2)
    return attend(*args, "matmul")
