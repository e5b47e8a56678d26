"""Decode attention in Triton: dense key/value, KIVI's packed codes, and Quest's pages read in place.

Every kernel is flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023): one
program per (row, KV head, split of the sequence) loads each tile of its KV head once for the whole GQA
group (``g`` query heads, padded to the 16 rows ``tl.dot`` needs), keeps an online softmax in float32,
and writes a partial (max, sum, weighted values); ``combine`` merges the splits. Tiles are read in the
cache's dtype and widened to float32 in registers (a 16-bit value is exact in tf32, so its products run
on tensor cores), so no whole-cache copy is ever upcast.

- ``dense``: key/value (B, H_kv, T, D) with an optional key-validity mask (padded rows, per-head
  evictions). With ``probs`` the pass also writes its float32 logits (B, H, T), which ``combine``
  normalises into the decode query's probabilities averaged per KV group: what score-based selectors
  (H2O, TOVA, block eviction) read, from the same pass as the output.
- ``kivi``: packed int8 / int4 / int2 codes in ``quantizer.pack``'s block layout, keys per channel or per
  token, values per token or per channel (Liu et al., KIVI, arXiv 2402.02750), dequantized tile by tile
  in registers, then the exact residual window in the same softmax.
- ``pages``: the pages of a page table (B, H_kv, k) read where they lie, no gathered copy (Tang et al.,
  Quest, arXiv 2406.10774).

On a CPU the same kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
imported), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # tokens per tile
TARGET_PROGRAMS = 256  # splits enough for this many programs in all (a GPU's SMs several times over)
MIN_ROWS = 16  # tl.dot's smallest tile side


@triton.jit
def _logits(q, k, scale, PREC: tl.constexpr):
    """Scaled logits (G, N) float32 of queries (G, D) over keys (N, D), both read as float32."""
    return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PREC) * scale


@triton.jit
def _online(logits, v, m_i, l_i, acc, PREC: tl.constexpr):
    """One tile's update of the online softmax: logits (G, N) float32, v (N, D)."""
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _program(pid, S, H_kv):
    """The (row, KV head, split) of program ``pid`` of ``B * H_kv * S``."""
    bh = pid // S
    return bh // H_kv, bh % H_kv, pid % S


@triton.jit
def _group_start(Q, base, sq_h, h, g, D, G: tl.constexpr, BD: tl.constexpr):
    """KV head ``h``'s group of ``g`` decode queries as rows (G, BD) (rows past ``g`` are 0), their row and
    channel offsets, and the online softmax's start: max, sum (G,) and weighted values (G, BD)."""
    rows, offs_d = tl.arange(0, G), tl.arange(0, BD)
    ok = (rows[:, None] < g) & (offs_d[None, :] < D)
    q = tl.load(Q + base + (h * g + rows)[:, None] * sq_h + offs_d[None, :], mask=ok, other=0.0)
    m_i, l_i = tl.full((G,), -1.0e30, tl.float32), tl.zeros((G,), tl.float32)
    return q, rows, offs_d, m_i, l_i, tl.zeros((G, BD), tl.float32)


@triton.jit
def _tile(PTR, base, offs_t, st, offs_d, ok):
    """Rows ``offs_t`` (stride ``st``) of a (T, D) matrix at ``base``, 0 where not ``ok``."""
    return tl.load(PTR + base + offs_t[:, None] * st + offs_d[None, :], mask=ok, other=0.0)


@triton.jit
def _finish(m_i, l_i, acc, pid, rows, offs_d, g, D, part_acc, part_m, part_l, S):
    """Write a program's partial (max, sum, weighted values) at split ``pid`` (B * H_kv, S) of its rows."""
    bh, s = pid // S, pid % S
    row_ok = rows < g
    base = (bh * g + rows) * S + s  # (G,) into (B, H, S)
    tl.store(part_m + base, m_i, mask=row_ok)
    tl.store(part_l + base, l_i, mask=row_ok)
    ptr = part_acc + base[:, None] * D + offs_d[None, :]
    tl.store(ptr, acc, mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _dense_kernel(
    Q, K, V, VALID, LOGITS, part_acc, part_m, part_l,
    H_kv, T, D, g, S, per_split, scale,
    sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sm_b, sm_h,
    HAS_VALID: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    G: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, h, s = _program(pid, S, H_kv)
    q, rows, offs_d, m_i, l_i, acc = _group_start(Q, b * sq_b, sq_h, h, g, D, G, BD)
    d_ok = offs_d < D
    start = s * per_split
    stop = tl.minimum(start + per_split, T)
    for t0 in range(start, stop, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < stop
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = _tile(K, b * sk_b + h * sk_h, offs_t, sk_t, offs_d, kv_ok)
        v = _tile(V, b * sv_b + h * sv_h, offs_t, sv_t, offs_d, kv_ok)
        logits = _logits(q, k, scale, PREC)  # (G, BT)
        ok = t_ok
        if HAS_VALID:
            ok = ok & (tl.load(VALID + b * sm_b + h * sm_h + offs_t, mask=t_ok, other=0) != 0)
        logits = tl.where(ok[None, :], logits, float("-inf"))
        if WRITE_LOGITS:
            ptr = LOGITS + (b * H_kv * g + h * g + rows)[:, None] * T + offs_t[None, :]
            tl.store(ptr, logits, mask=(rows[:, None] < g) & t_ok[None, :])
        m_i, l_i, acc = _online(logits, v, m_i, l_i, acc, PREC)
    _finish(m_i, l_i, acc, pid, rows, offs_d, g, D, part_acc, part_m, part_l, S)


@triton.jit
def _codes_tile(CODES, SCALE, ZERO, base_c, base_s, offs_t, offs_d, ok, st_c, st_s, sd_s, W, group, bits,
                PER_CHANNEL: tl.constexpr):  # fmt: skip
    """Dequantized tile (BT, BD) float32 of packed codes: channel ``d`` is plane ``d // W`` of byte
    ``d % W``; a scale is shared by ``group`` tokens of a channel or ``group`` channels of a token."""
    byte = tl.load(CODES + base_c + offs_t[:, None] * st_c + (offs_d % W)[None, :], mask=ok, other=0)
    code = (byte.to(tl.int32) >> ((offs_d // W) * bits)[None, :]) & ((1 << bits) - 1)
    if PER_CHANNEL:
        idx = base_s + (offs_t // group)[:, None] * st_s + offs_d[None, :] * sd_s
    else:
        idx = base_s + offs_t[:, None] * st_s + (offs_d // group)[None, :] * sd_s
    scale = tl.load(SCALE + idx, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(ZERO + idx, mask=ok, other=0.0).to(tl.float32)
    return zero + scale * code.to(tl.float32)


@triton.jit
def _kivi_kernel(
    Q, KC, KS, KZ, VC, VS, VZ, part_acc, part_m, part_l,
    H_kv, T, D, W, g, S, per_split, scale, bits, group,
    sq_b, sq_h, skc_b, skc_h, skc_t, sks_b, sks_h, sks_t, sks_d,
    svc_b, svc_h, svc_t, svs_b, svs_h, svs_t, svs_d,
    KEY_CHANNEL: tl.constexpr, VALUE_CHANNEL: tl.constexpr,
    G: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, h, s = _program(pid, S, H_kv)
    q, rows, offs_d, m_i, l_i, acc = _group_start(Q, b * sq_b, sq_h, h, g, D, G, BD)
    d_ok = offs_d < D
    start = s * per_split
    stop = tl.minimum(start + per_split, T)
    for t0 in range(start, stop, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < stop
        ok = t_ok[:, None] & d_ok[None, :]
        k = _codes_tile(KC, KS, KZ, b * skc_b + h * skc_h, b * sks_b + h * sks_h, offs_t, offs_d, ok,
                        skc_t, sks_t, sks_d, W, group, bits, KEY_CHANNEL)  # fmt: skip
        v = _codes_tile(VC, VS, VZ, b * svc_b + h * svc_h, b * svs_b + h * svs_h, offs_t, offs_d, ok,
                        svc_t, svs_t, svs_d, W, group, bits, VALUE_CHANNEL)  # fmt: skip
        logits = _logits(q, k, scale, PREC)
        logits = tl.where(t_ok[None, :], logits, float("-inf"))
        m_i, l_i, acc = _online(logits, v, m_i, l_i, acc, PREC)
    _finish(m_i, l_i, acc, pid, rows, offs_d, g, D, part_acc, part_m, part_l, S)


@triton.jit
def _pages_kernel(
    Q, K, V, PAGES, part_acc, part_m, part_l,
    H_kv, P, D, g, S, per_split, scale, block, total,
    sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sp_b, sp_h,
    G: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, h, s = _program(pid, S, H_kv)
    q, rows, offs_d, m_i, l_i, acc = _group_start(Q, b * sq_b, sq_h, h, g, D, G, BD)
    d_ok = offs_d < D
    offs_p = tl.arange(0, BP)
    start = s * per_split
    stop = tl.minimum(start + per_split, P)
    for i in range(start, stop):
        page = tl.load(PAGES + b * sp_b + h * sp_h + i).to(tl.int64)
        offs_t = page * block + offs_p
        t_ok = (offs_p < block) & (offs_t >= 0) & (offs_t < total)  # page -1 (an unused slot): none
        ok = t_ok[:, None] & d_ok[None, :]
        k = _tile(K, b * sk_b + h * sk_h, offs_t, sk_t, offs_d, ok)
        v = _tile(V, b * sv_b + h * sv_h, offs_t, sv_t, offs_d, ok)
        logits = _logits(q, k, scale, PREC)
        logits = tl.where(t_ok[None, :], logits, float("-inf"))
        m_i, l_i, acc = _online(logits, v, m_i, l_i, acc, PREC)
    _finish(m_i, l_i, acc, pid, rows, offs_d, g, D, part_acc, part_m, part_l, S)


@triton.jit
def _window_logits_kernel(
    Q, K, VALID, LOGITS,
    H_kv, T, D, g, n, S, per_split, scale,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_t, sm_b, sm_h,
    HAS_VALID: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Scaled logits (B, H, n, T) float32 of a step's last ``n`` queries (row ``r`` of a program: query head
    ``r // n`` of the group, window query ``r % n`` at key position ``T - n + r % n``), causal, -inf where
    not attended."""
    b, h, s = _program(tl.program_id(0), S, H_kv)
    rows, offs_d = tl.arange(0, R), tl.arange(0, BD)
    head, i = h * g + rows // n, rows % n
    row_ok = rows < g * n
    d_ok = offs_d < D
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + i[:, None] * sq_n + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    start = s * per_split
    stop = tl.minimum(start + per_split, T)
    for t0 in range(start, stop, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < stop
        k = _tile(K, b * sk_b + h * sk_h, offs_t, sk_t, offs_d, t_ok[:, None] & d_ok[None, :])
        logits = _logits(q, k, scale, PREC)  # (R, BT)
        ok = t_ok[None, :] & (offs_t[None, :] <= (T - n + i)[:, None])
        if HAS_VALID:
            ok = ok & (tl.load(VALID + b * sm_b + h * sm_h + offs_t, mask=t_ok, other=0) != 0)[None, :]
        ptr = LOGITS + ((b * H_kv * g + head) * n + i)[:, None] * T + offs_t[None, :]
        tl.store(ptr, tl.where(ok, logits, float("-inf")), mask=row_ok[:, None] & t_ok[None, :])


# -- launching ------------------------------------------------------------------------------


def _rows(g: int) -> int:
    return max(MIN_ROWS, triton.next_power_of_2(g))


def _splits(items: int, programs: int, unit: int) -> tuple[int, int]:
    """Splits of ``items`` (in multiples of ``unit``) so that ``programs`` x splits nears the target."""
    want = max(1, min(triton.cdiv(items, unit), TARGET_PROGRAMS // max(programs, 1)))
    per = triton.cdiv(triton.cdiv(items, want), unit) * unit
    return triton.cdiv(items, per) if items else 1, max(per, unit)


def _partials(b: int, h: int, s: int, d: int, device) -> tuple[torch.Tensor, ...]:
    acc = torch.zeros(b, h, s, d, dtype=torch.float32, device=device)
    m = torch.full((b, h, s), -1.0e30, dtype=torch.float32, device=device)
    return acc, m, torch.zeros(b, h, s, dtype=torch.float32, device=device)


def _query(query: torch.Tensor) -> torch.Tensor:
    """The decode query (B, H, 1, D) as (B, H, D), unit stride on D."""
    q = query[:, :, 0]
    return q if q.stride(-1) == 1 else q.contiguous()


def _precision(x: torch.Tensor) -> str:
    """``tl.dot``'s input precision: a 16-bit cache's values are exact in tf32 (8 or 10 mantissa bits), a
    float32 one needs full float32 products."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _mask_strides(vm: torch.Tensor | None) -> tuple[int, int]:
    """Row and head strides of a validity mask (B or 1, 1 or H_kv, T), 0 along a broadcast dimension."""
    if vm is None:
        return 0, 0
    return (vm.stride(0) if vm.shape[0] > 1 else 0), (vm.stride(1) if vm.shape[1] > 1 else 0)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def dense_partials(query, key, value, scaling: float, valid=None, logits=None):
    """Partials (acc (B, H, S, D), m, l (B, H, S)) of decode queries (B, H, 1, D) over key/value
    (B, H_kv, T, D); ``valid`` (B or 1, 1 or H_kv, T) bool marks the keys to attend, None for all;
    ``logits`` (B, H, T) float32 receives the scaled logits (-inf where not attended)."""
    q, key, value = _query(query), _unit(key), _unit(value)
    b, h, d = q.shape
    h_kv, t = key.shape[1], key.shape[2]
    s, per = _splits(t, b * h_kv, BLOCK_T)
    parts = _partials(b, h, s, d, q.device)
    vm = valid if valid is None else _unit(valid.to(torch.int8))
    vs = _mask_strides(vm)
    if t:
        _dense_kernel[(b * h_kv * s,)](
            q, key, value, vm if vm is not None else q, logits if logits is not None else q, *parts,
            h_kv, t, d, h // h_kv, s, per, scaling,
            q.stride(0), q.stride(1), *key.stride()[:3], *value.stride()[:3], *vs,
            HAS_VALID=vm is not None, WRITE_LOGITS=logits is not None,
            G=_rows(h // h_kv), BD=triton.next_power_of_2(d), BT=BLOCK_T, PREC=_precision(key),
        )  # fmt: skip
    return parts


def kivi_partials(query, keys, values, scaling: float, bits: int, group: int, key_channel: bool = True,
                  value_channel: bool = False):  # fmt: skip
    """Partials of decode queries (B, H, 1, D) over quantized tokens: ``keys``/``values`` are (codes
    (B, H_kv, Te, D * bits / 8) uint8, scale, zero), per channel ((B, H_kv, Te / G, D)) or per token
    ((B, H_kv, Te, D / G))."""
    q = _query(query)
    b, h, d = q.shape
    (kc, ks, kz), (vc, vs, vz) = [tuple(_unit(x) for x in parts) for parts in (keys, values)]
    h_kv, t, w = kc.shape[1], kc.shape[2], kc.shape[3]
    s, per = _splits(t, b * h_kv, BLOCK_T)
    parts = _partials(b, h, s, d, q.device)
    if t:
        _kivi_kernel[(b * h_kv * s,)](
            q, kc, ks, kz, vc, vs, vz, *parts,
            h_kv, t, d, w, h // h_kv, s, per, scaling, bits, group,
            q.stride(0), q.stride(1), *kc.stride()[:3], *ks.stride(),
            *vc.stride()[:3], *vs.stride(),
            KEY_CHANNEL=key_channel, VALUE_CHANNEL=value_channel,
            G=_rows(h // h_kv), BD=triton.next_power_of_2(d), BT=BLOCK_T, PREC=_precision(q),
        )  # fmt: skip
    return parts


def pages_partials(query, key, value, pages, block: int, total: int, scaling: float):
    """Partials of decode queries (B, H, 1, D) over ``pages`` (B, H_kv, k) of key/value (B, H_kv, T, D),
    pages of ``block`` tokens of which the first ``total`` slots are stored."""
    q, key, value, pages = _query(query), _unit(key), _unit(value), _unit(pages)
    b, h, d = q.shape
    h_kv, n = key.shape[1], pages.shape[-1]
    s, per = _splits(n, b * h_kv, 1)
    parts = _partials(b, h, s, d, q.device)
    if n:
        _pages_kernel[(b * h_kv * s,)](
            q, key, value, pages, *parts,
            h_kv, n, d, h // h_kv, s, per, scaling, block, total,
            q.stride(0), q.stride(1), *key.stride()[:3], *value.stride()[:3], *pages.stride()[:2],
            G=_rows(h // h_kv), BD=triton.next_power_of_2(d), PREC=_precision(key),
            BP=max(MIN_ROWS, triton.next_power_of_2(block)),
        )  # fmt: skip
    return parts


def combine(*partials, logits=None, kv_heads: int = 1):
    """Merge partials (acc, m, l) along their splits: the output (B, 1, H, D) float32 and, from ``logits``
    (B, H, T), the probabilities averaged per KV group (B, H_kv, 1, T) float32 (else None)."""
    acc = torch.cat([p[0] for p in partials], 2)  # (B, H, S, D)
    m = torch.cat([p[1] for p in partials], 2)  # (B, H, S)
    l_s = torch.cat([p[2] for p in partials], 2)
    top = m.amax(-1, keepdim=True)  # (B, H, 1)
    w = torch.exp(m - top)
    total = (l_s * w).sum(-1, keepdim=True).clamp(min=1e-30)  # a row that attends nothing gives zeros
    out = (acc * w[..., None]).sum(2) / total  # (B, H, D)
    b, h, d = out.shape
    probs = None
    if logits is not None:
        p = torch.exp(logits - top) / total  # (B, H, T)
        probs = p.view(b, kv_heads, h // kv_heads, -1).mean(2, keepdim=True)
    return out.view(b, 1, h, d), probs


def dense(query, key, value, scaling: float, valid=None, probs: bool = False):
    """Decode attention (B, 1, H, D) in the query's dtype, and with ``probs`` the probabilities
    (B, H_kv, 1, T) float32 averaged per KV group."""
    b, h = query.shape[:2]
    logits = torch.empty(b, h, key.shape[2], dtype=torch.float32, device=query.device) if probs else None
    parts = dense_partials(query, key, value, scaling, valid, logits)
    out, p = combine(parts, logits=logits, kv_heads=key.shape[1])
    return out.to(query.dtype), p


def kivi(query, keys, values, key_res, value_res, scaling: float, bits: int, group: int, **axes):
    """Decode attention (B, 1, H, D) over quantized tokens then the exact residual window (B, H_kv, Tr, D),
    one softmax."""
    coded = kivi_partials(query, keys, values, scaling, bits, group, **axes)
    exact = dense_partials(query, key_res, value_res, scaling)
    return combine(coded, exact)[0].to(query.dtype)


def pages_attention(query, key, value, pages, block: int, total: int, scaling: float):
    """Decode attention (B, 1, H, D) over the chosen pages, read in place."""
    return combine(pages_partials(query, key, value, pages, block, total, scaling))[0].to(query.dtype)


def window_scores(query, key, scaling: float, valid=None) -> torch.Tensor:
    """``torch_attention.window_scores`` from one pass over the keys in their own dtype: the last
    ``w`` queries (B, H, w, D) over key (B, H_kv, T, D), ``valid`` (B, 1 or H_kv, T) or None. Returns
    (B, H_kv, w, T) float32 probabilities averaged per KV group, padding keys and padding queries 0."""
    b, h, w, d = query.shape
    key = _unit(key)
    query = query if query.stride(-1) == 1 else query.contiguous()
    h_kv, t = key.shape[1], key.shape[2]
    g = h // h_kv
    logits = torch.empty(b, h, w, t, dtype=torch.float32, device=query.device)
    s, per = _splits(t, b * h_kv, BLOCK_T)
    vm = None if valid is None else _unit(valid.to(torch.int8))
    vs = _mask_strides(vm)
    if t:
        _window_logits_kernel[(b * h_kv * s,)](
            query, key, vm if vm is not None else query, logits,
            h_kv, t, d, g, w, s, per, scaling,
            query.stride(0), query.stride(1), query.stride(2), *key.stride()[:3], *vs,
            HAS_VALID=vm is not None, R=max(MIN_ROWS, triton.next_power_of_2(g * w)),
            BD=triton.next_power_of_2(d), BT=BLOCK_T, PREC=_precision(key),
        )  # fmt: skip
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # fully masked rows (padding queries) become 0
    return probs.view(b, h_kv, g, w, t).mean(dim=2)
