// Decode logits over pre-RoPE low-rank keys: each key is rebuilt from its latent, rotated at its own
// position and dotted with the GQA group's queries while it sits in registers and L1, so no (T, D) copy of
// the keys, of their rotation or of the cos/sin of every position is written. Palu (arXiv 2407.21118) and
// ShadowKV (arXiv 2410.21465) fuse the same rebuild-and-rotate on a GPU; the algebra, the half-split pairing
// (RoFormer, arXiv 2104.09864) and the checks that the model uses it are in kvcompress/kernels/fused_low_rank.py.
#include "aten.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "vector.h"

namespace {

constexpr int64_t CHUNK = 288;  // tokens per parallel task (whole tiles)
constexpr int64_t MAX_TILE = 48;  // tokens rebuilt, rotated and dotted together (one reduction per query and
// 16 tokens); a multiple of every register tile below, so only a span's last tile repeats a token

// The inputs of one call, checked, as raw pointers and strides.
struct Inputs {
  const float *q, *coef, *dect, *cos, *sin;
  const int32_t* pos;
  int64_t b, hk, n, d, blocks, g, t, r, rows, half;
  int64_t cb, cg, ct;  // coefficient strides (batch, block, token); components are contiguous
  int64_t pb, pg;  // position strides (batch, block); tokens are contiguous

  Inputs(const at::Tensor& q_, const at::Tensor& coef_, const at::Tensor& dect_,
         const at::Tensor& pos_, const at::Tensor& cos_, const at::Tensor& sin_) {
    TORCH_CHECK(q_.scalar_type() == at::kFloat && q_.dim() == 4 && q_.is_contiguous() && q_.device().is_cpu(),
                "q: expected a contiguous float32 CPU tensor (B, H_kv, n, D)");
    for (const auto* t : {&coef_, &dect_, &pos_, &cos_, &sin_})
      TORCH_CHECK(t->device().is_cpu(), "rope_logits: every input must be a CPU tensor");
    TORCH_CHECK(coef_.scalar_type() == at::kFloat && coef_.dim() == 4 && coef_.stride(3) == 1,
                "coef: expected float32 (B, G, T, R) with contiguous components");
    TORCH_CHECK(dect_.scalar_type() == at::kFloat && dect_.dim() == 3 && dect_.is_contiguous(),
                "dect: expected contiguous float32 (G, R, g * D)");
    TORCH_CHECK(pos_.scalar_type() == at::kInt && pos_.dim() == 3 && pos_.stride(2) == 1,
                "positions: expected int32 (B, G, T) with contiguous tokens");
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && cos_.dim() == 2 && cos_.is_contiguous() &&
                    sin_.sizes() == cos_.sizes() && sin_.scalar_type() == at::kFloat && sin_.is_contiguous(),
                "cos, sin: expected contiguous float32 (P, rotary_dim / 2) tables of one shape");
    b = q_.size(0), hk = q_.size(1), n = q_.size(2), d = q_.size(3);
    blocks = coef_.size(1), t = coef_.size(2), r = coef_.size(3), rows = cos_.size(0), half = cos_.size(1);
    TORCH_CHECK(blocks > 0 && hk % blocks == 0 && coef_.size(0) == b, "coef: blocks must divide H_kv");
    g = hk / blocks;
    TORCH_CHECK(dect_.size(0) == blocks && dect_.size(1) == r && dect_.size(2) == g * d,
                "dect: expected (G, R, g * D) for the coefficients' G and R");
    TORCH_CHECK(pos_.size(0) == b && pos_.size(1) == blocks && pos_.size(2) == t, "positions: expected (B, G, T)");
    TORCH_CHECK(2 * half <= d, "cos, sin: rotary_dim / 2 columns, at most D / 2");
    q = q_.data_ptr<float>(), coef = coef_.data_ptr<float>(), dect = dect_.data_ptr<float>();
    cos = cos_.data_ptr<float>(), sin = sin_.data_ptr<float>(), pos = pos_.data_ptr<int32_t>();
    cb = coef_.stride(0), cg = coef_.stride(1), ct = coef_.stride(2), pb = pos_.stride(0), pg = pos_.stride(1);
  }
};

// keys[k][0..D) = sum_j c[k][j] w[j][0..D) for k < m tokens; w rows are ``ld`` floats apart.
inline void rebuild_scalar(const float* c, int64_t ct, int64_t m, int64_t r, const float* w, int64_t ld,
                           int64_t d, float* keys) {
  std::fill(keys, keys + m * d, 0.f);
  for (int64_t k = 0; k < m; ++k) {
    float* out = keys + k * d;
    for (int64_t j = 0; j < r; ++j) {
      const float cj = c[k * ct + j];
      const float* wj = w + j * ld;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) out[e] += cj * wj[e];
    }
  }
}

#if defined(__AVX512F__)
// rebuild_scalar() for D = 16 * NR: TILE tokens' accumulators (TILE * NR <= 24 registers, beside the NR
// decoder rows and a broadcast) stay in registers over the R components, and with a ``rot`` table (cos, sin
// rows of D / 2 floats by position) they are rotated there before the one store. A token past m repeats the
// last one's coefficients and is not stored. No contraction into fused multiply-adds beyond the explicit
// ones of the rebuild, so the rotation rounds as turn_row() does.
template <int NR, int TILE>
__attribute__((optimize("fp-contract=off"))) void rebuild_wide(const float* c, int64_t ct, int64_t m, int64_t r,
                                                                const float* w, int64_t ld, float* keys,
                                                                const int32_t* pos, const float* cs,
                                                                const float* sn) {
  for (int64_t k0 = 0; k0 < m; k0 += TILE) {
    __m512 acc[TILE][NR];
    const float* row[TILE];
    for (int k = 0; k < TILE; ++k) {
      row[k] = c + std::min<int64_t>(k0 + k, m - 1) * ct;
      for (int x = 0; x < NR; ++x) acc[k][x] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < r; ++j) {
      __m512 wj[NR];
      for (int x = 0; x < NR; ++x) wj[x] = _mm512_loadu_ps(w + j * ld + 16 * x);
      for (int k = 0; k < TILE; ++k) {
        const __m512 cj = _mm512_set1_ps(row[k][j]);
        for (int x = 0; x < NR; ++x) acc[k][x] = _mm512_fmadd_ps(cj, wj[x], acc[k][x]);
      }
    }
    constexpr int H = NR / 2;  // the rotation pairs register x with x + H (half-split pairs, D = 32 * H),
    // each product and sum rounded on its own as in turn_row(): the same bits
    for (int k = 0; k < TILE && k0 + k < m && cs != nullptr && NR % 2 == 0; ++k)
      for (int x = 0; x < H; ++x) {
        const __m512 co = _mm512_loadu_ps(cs + static_cast<int64_t>(pos[k0 + k]) * 8 * NR + 16 * x);
        const __m512 si = _mm512_loadu_ps(sn + static_cast<int64_t>(pos[k0 + k]) * 8 * NR + 16 * x);
        const __m512 a = acc[k][x], b = acc[k][x + H];
        acc[k][x] = _mm512_sub_ps(_mm512_mul_ps(a, co), _mm512_mul_ps(b, si));
        acc[k][x + H] = _mm512_add_ps(_mm512_mul_ps(b, co), _mm512_mul_ps(a, si));
      }
    for (int k = 0; k < TILE && k0 + k < m; ++k)
      for (int x = 0; x < NR; ++x) _mm512_storeu_ps(keys + (k0 + k) * 16 * NR + 16 * x, acc[k][x]);
  }
}

// Whether rebuild_wide() serves this head_dim, and then runs it; it also rotates when ``cs`` is given (the
// table's rows are then D / 2 floats: every channel turns).
inline bool rebuild_fast(const float* c, int64_t ct, int64_t m, int64_t r, const float* w, int64_t ld,
                         int64_t d, float* keys, const int32_t* pos, const float* cs, const float* sn) {
  switch (d) {
    case 16: rebuild_wide<1, 16>(c, ct, m, r, w, ld, keys, pos, cs, sn); return true;
    case 32: rebuild_wide<2, 8>(c, ct, m, r, w, ld, keys, pos, cs, sn); return true;
    case 64: rebuild_wide<4, 6>(c, ct, m, r, w, ld, keys, pos, cs, sn); return true;
    case 96: rebuild_wide<6, 3>(c, ct, m, r, w, ld, keys, pos, cs, sn); return true;
    case 128: rebuild_wide<8, 2>(c, ct, m, r, w, ld, keys, pos, cs, sn); return true;
    default: return false;
  }
}
#else
inline bool rebuild_fast(const float*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*,
                         const int32_t*, const float*, const float*) {
  return false;
}
#endif

// One key's half-split pairs turned by cos/sin rows (half floats each): a' = a c - b s, b' = b c + a s, each
// product and sum rounded on its own as torch's rope_table.rotate_halves() rounds them (no fused multiply-add:
// the same bits). Channels past 2 * half are copied.
__attribute__((optimize("fp-contract=off"))) void turn_row(const float* x, const float* c, const float* s,
                                                            int64_t half, int64_t d, float* out) {
  int64_t e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= half; e += 16) {
    const __m512 a = _mm512_loadu_ps(x + e), b = _mm512_loadu_ps(x + half + e);
    const __m512 co = _mm512_loadu_ps(c + e), si = _mm512_loadu_ps(s + e);
    _mm512_storeu_ps(out + e, _mm512_sub_ps(_mm512_mul_ps(a, co), _mm512_mul_ps(b, si)));
    _mm512_storeu_ps(out + half + e, _mm512_add_ps(_mm512_mul_ps(b, co), _mm512_mul_ps(a, si)));
  }
#endif
  for (; e < half; ++e) {
    const float ac = x[e] * c[e], bs = x[half + e] * s[e], bc = x[half + e] * c[e], as = x[e] * s[e];
    out[e] = ac - bs;
    out[half + e] = bc + as;
  }
  for (e = 2 * half; e < d; ++e) out[e] = x[e];
}

// Rotates m keys (rows of D floats) in place at their positions' cos/sin rows (turn_row()).
inline void rotate_rows(float* keys, int64_t m, const int32_t* pos, const Inputs& in) {
  for (int64_t k = 0; k < m; ++k) {
    float* key = keys + k * in.d;
    turn_row(key, in.cos + pos[k] * in.half, in.sin + pos[k] * in.half, in.half, in.d, key);
  }
}

// out[i * T + k] = q_i . keys[k] for the n queries (rows of D floats) and the m keys.
inline void dot_rows(const float* keys, int64_t m, const float* q, const Inputs& in, float* out) {
#if defined(__AVX512F__)
  if (m % 16 == 0 && in.d % 16 == 0) {  // one transposing reduction per query and 16 tokens
    for (int64_t k = 0; k < m; k += 16)
      for (int64_t i = 0; i < in.n; ++i)
        _mm512_storeu_ps(out + i * in.t + k, kvc::dots16(q + i * in.d, keys + k * in.d, in.d));
    return;
  }
#endif
  for (int64_t i = 0; i < in.n; ++i)
    for (int64_t k = 0; k < m; ++k) out[i * in.t + k] = kvc::dot(q + i * in.d, keys + k * in.d, in.d);
}

// Logits of one block's g heads x n queries over tokens [t0, t1) of batch row x.
void block_span(const Inputs& in, int64_t x, int64_t blk, int64_t t0, int64_t t1, float* out, float* keys) {
  const float* c = in.coef + x * in.cb + blk * in.cg;
  const int32_t* pos = in.pos + x * in.pb + blk * in.pg;
  const int64_t gd = in.g * in.d;
  for (int64_t k0 = t0; k0 < t1; k0 += MAX_TILE) {
    const int64_t m = std::min(MAX_TILE, t1 - k0);
    if (k0 + MAX_TILE < in.t)  // the next tile's latents (memory-bound otherwise: a third slower at 4k)
      kvc::prefetch(c + (k0 + MAX_TILE) * in.ct, std::min(MAX_TILE, in.t - k0 - MAX_TILE) * in.ct);
    for (int64_t h = 0; h < in.g; ++h) {
      const float* w = in.dect + blk * in.r * gd + h * in.d;  // head h's columns of (R, g * D)
      // every channel rotates, in pairs of whole registers: turned in registers during the rebuild
      const bool turn = 2 * in.half == in.d && in.d % 32 == 0;
      const bool fast = rebuild_fast(c + k0 * in.ct, in.ct, m, in.r, w, gd, in.d, keys, pos + k0,
                                     turn ? in.cos : nullptr, in.sin);
      if (!fast) rebuild_scalar(c + k0 * in.ct, in.ct, m, in.r, w, gd, in.d, keys);
      const float* q = in.q + ((x * in.hk) + blk * in.g + h) * in.n * in.d;  // (n, D) of KV head h
      float* o = out + ((x * in.blocks + blk) * in.g * in.n + h * in.n) * in.t;  // rows h * n.. of g * n
      if (!fast || !turn) rotate_rows(keys, m, pos + k0, in);
      dot_rows(keys, m, q, in, o + k0);
    }
  }
}

}  // namespace

// q (B, H_kv, n, D) float32 contiguous (scaled); coef (B, G, T, R) float32 latents of pre-RoPE keys;
// dect (G, R, g * D): each block's decoder, transposed; positions (B, G, T) int32; cos, sin (P, half) the
// rotary tables by position. Returns the logits (B, G, g * n, T), or None when a position has no table row
// (past P: the caller extends the tables and calls again; negative: it rotates with the model's module).
std::optional<at::Tensor> rope_logits(at::Tensor q, at::Tensor coef, at::Tensor dect,
                                               at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  const Inputs in(q, coef, dect, positions, cos, sin);
  for (int64_t x = 0; x < in.b; ++x)
    for (int64_t blk = 0; blk < in.blocks; ++blk) {
      const int32_t* p = in.pos + x * in.pb + blk * in.pg;
      for (int64_t k = 0; k < in.t; ++k)
        if (p[k] < 0 || p[k] >= in.rows) return std::nullopt;
    }
  auto out = at::empty({in.b, in.blocks, in.g * in.n, in.t}, q.options());
  float* op = out.data_ptr<float>();
  const int64_t chunks = (in.t + CHUNK - 1) / CHUNK;
  at::parallel_for(0, in.b * in.blocks * chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> keys(MAX_TILE * in.d);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t chunk = task / (in.b * in.blocks), xb = task % (in.b * in.blocks);  // chunk-major: a
      // chunk's cos/sin rows are read from memory once, then from L2 by the other blocks of heads
      const int64_t t0 = chunk * CHUNK, t1 = std::min(in.t, t0 + CHUNK);
      block_span(in, xb / in.blocks, xb % in.blocks, t0, t1, op, keys.data());
    }
  });
  return out;
}

// x (B, H, n, D) float32 contiguous; positions (B, h, n) int32 contiguous, h dividing H (row r of a block of
// H / h heads); cos, sin (P, half) rows by position (the inverse rows to un-rotate). Returns the turned keys
// (B, H, n, D), or None when a position has no row (the caller uses the model's module instead).
std::optional<at::Tensor> turn_keys(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 4 && x.is_contiguous() && x.device().is_cpu(),
              "x: expected a contiguous float32 CPU tensor (B, H, n, D)");
  TORCH_CHECK(positions.scalar_type() == at::kInt && positions.dim() == 3 && positions.is_contiguous() &&
                  positions.size(0) == x.size(0) && positions.size(2) == x.size(2) && positions.size(1) > 0 &&
                  x.size(1) % positions.size(1) == 0,
              "positions: expected contiguous int32 (B, h, n), h dividing x's H");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous() &&
                  2 * cos.size(1) <= x.size(3),
              "cos, sin: expected contiguous float32 (P, half) tables of one shape, half <= D / 2");
  const int64_t b = x.size(0), hk = x.size(1), n = x.size(2), d = x.size(3), h = positions.size(1);
  const int64_t rows = cos.size(0), half = cos.size(1);
  const int32_t* pos = positions.data_ptr<int32_t>();
  for (int64_t i = 0; i < positions.numel(); ++i)
    if (pos[i] < 0 || pos[i] >= rows) return std::nullopt;
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < hk; ++hi)
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = pos[(bi * h + hi / (hk / h)) * n + t], at = ((bi * hk + hi) * n + t) * d;
        turn_row(xp + at, cp + p * half, sp + p * half, half, d, op + at);
      }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_isa", &kvc::vector_isa, "the vector instructions of this build (avx512 or portable)");
  m.def("rope_logits", &rope_logits, "decode logits over pre-RoPE low-rank keys, rebuilt and rotated in place");
  m.def("turn_keys", &turn_keys, "keys turned by cos/sin rows at their positions (half-split pairs)");
}
