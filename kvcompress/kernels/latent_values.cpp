// The probabilities' mix of low-rank latents, sum_t p[i][t] c[t], for decode attention in the latent space:
// the value decoder then projects the (m, R) result once per query head (kvcompress/kernels/fused_low_rank.py;
// Palu, arXiv 2407.21118). A matrix product of a few rows by T tokens is what a BLAS does worst (about four
// times the time of reading the latents on a CPU): here each token's latent is read once, from L1, by every
// row of its block, into accumulators that stay in registers over a span of tokens.
#include "aten.h"

#include <algorithm>

#include "vector.h"

namespace {

constexpr int64_t SPAN = 64;  // tokens whose latents stay in L1 while every tile of rows and columns reads them

struct Mix {
  const float* p;  // (m, T) of one block, rows ``ps`` floats apart, tokens contiguous
  const float* c;  // (T, R) of one block, tokens ``cs`` floats apart, components contiguous
  float* out;      // (m, R) contiguous, accumulated over spans
  int64_t ps, cs, r;
};

// out[i0 + i][f0 + f] += sum_{t in [t0, t1)} p[i0 + i][t] c[t][f0 + f] for i < RB rows and f < 16 * VB
// components.
#if defined(__AVX512F__)
template <int RB, int VB>
inline void tile(const Mix& x, int64_t t0, int64_t t1, int64_t i0, int64_t f0) {
  constexpr int U = RB * VB <= 4 ? 2 : 1;  // few accumulators: two token streams hide the FMA latency
  __m512 acc[U][RB][VB];
  for (int i = 0; i < RB; ++i)
    for (int v = 0; v < VB; ++v) {
      acc[0][i][v] = _mm512_loadu_ps(x.out + (i0 + i) * x.r + f0 + 16 * v);
      if constexpr (U == 2) acc[U - 1][i][v] = _mm512_setzero_ps();
    }
  int64_t t = t0;
  for (; t + U <= t1; t += U)
    for (int u = 0; u < U; ++u) {
      __m512 cv[VB];
      for (int v = 0; v < VB; ++v) cv[v] = _mm512_loadu_ps(x.c + (t + u) * x.cs + f0 + 16 * v);
      for (int i = 0; i < RB; ++i) {
        const __m512 pi = _mm512_set1_ps(x.p[(i0 + i) * x.ps + t + u]);
        for (int v = 0; v < VB; ++v) acc[u][i][v] = _mm512_fmadd_ps(pi, cv[v], acc[u][i][v]);
      }
    }
  for (; t < t1; ++t)  // an odd last token
    for (int i = 0; i < RB; ++i) {
      const __m512 pi = _mm512_set1_ps(x.p[(i0 + i) * x.ps + t]);
      for (int v = 0; v < VB; ++v)
        acc[0][i][v] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(x.c + t * x.cs + f0 + 16 * v), acc[0][i][v]);
    }
  for (int i = 0; i < RB; ++i)
    for (int v = 0; v < VB; ++v) {
      if constexpr (U == 2) acc[0][i][v] = _mm512_add_ps(acc[0][i][v], acc[1][i][v]);
      _mm512_storeu_ps(x.out + (i0 + i) * x.r + f0 + 16 * v, acc[0][i][v]);
    }
}

// Rows [i0, i0 + RB) over every component (R a multiple of 16): tiles of 4, 2 and 1 registers.
template <int RB>
inline void rows(const Mix& x, int64_t t0, int64_t t1, int64_t i0) {
  int64_t f0 = 0;
  for (; f0 + 64 <= x.r; f0 += 64) tile<RB, 4>(x, t0, t1, i0, f0);
  for (; f0 + 32 <= x.r; f0 += 32) tile<RB, 2>(x, t0, t1, i0, f0);
  for (; f0 < x.r; f0 += 16) tile<RB, 1>(x, t0, t1, i0, f0);
}

// One block's (m, R) mix, span by span of tokens.
void block(const Mix& x, int64_t m, int64_t t) {
  for (int64_t t0 = 0; t0 < t; t0 += SPAN) {
    const int64_t t1 = std::min(t, t0 + SPAN);
    if (t1 < t) kvc::prefetch(x.c + t1 * x.cs, std::min(SPAN, t - t1) * x.cs);  // the next span's latents
    int64_t i0 = 0;
    for (; i0 + 4 <= m; i0 += 4) rows<4>(x, t0, t1, i0);
    for (; i0 + 3 <= m; i0 += 3) rows<3>(x, t0, t1, i0);
    for (; i0 < m; ++i0) rows<1>(x, t0, t1, i0);
  }
}
#endif

// The same sums on any CPU: tiles of RB rows by W components accumulate in local arrays the compiler keeps
// in vector registers (W = 8: two SSE or NEON registers per row, one AVX2 register) over a span of tokens;
// components past the last whole tile are summed one at a time. The portable build, and AVX-512 builds
// where R is not a multiple of 16.
template <int RB>
inline void tile_portable(const Mix& x, int64_t t0, int64_t t1, int64_t i0, int64_t f0) {
  constexpr int W = 8;
  float acc[RB][W];
  for (int i = 0; i < RB; ++i)
    for (int f = 0; f < W; ++f) acc[i][f] = x.out[(i0 + i) * x.r + f0 + f];
  for (int64_t t = t0; t < t1; ++t) {
    const float* c = x.c + t * x.cs + f0;
    for (int i = 0; i < RB; ++i) {
      const float p = x.p[(i0 + i) * x.ps + t];
#pragma omp simd
      for (int f = 0; f < W; ++f) acc[i][f] += p * c[f];
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int f = 0; f < W; ++f) x.out[(i0 + i) * x.r + f0 + f] = acc[i][f];
}

template <int RB>
inline void rows_portable(const Mix& x, int64_t t0, int64_t t1, int64_t i0) {
  int64_t f0 = 0;
  for (; f0 + 8 <= x.r; f0 += 8) tile_portable<RB>(x, t0, t1, i0, f0);
  for (int64_t f = f0; f < x.r; ++f)  // the last components, one at a time
    for (int i = 0; i < RB; ++i) {
      float acc = x.out[(i0 + i) * x.r + f];
      for (int64_t t = t0; t < t1; ++t) acc += x.p[(i0 + i) * x.ps + t] * x.c[t * x.cs + f];
      x.out[(i0 + i) * x.r + f] = acc;
    }
}

void block_portable(const Mix& x, int64_t m, int64_t t) {
  for (int64_t t0 = 0; t0 < t; t0 += SPAN) {
    const int64_t t1 = std::min(t, t0 + SPAN);
    int64_t i0 = 0;
    for (; i0 + 3 <= m; i0 += 3) rows_portable<3>(x, t0, t1, i0);
    for (; i0 < m; ++i0) rows_portable<1>(x, t0, t1, i0);
  }
}

}  // namespace

// probs (B, G, m, T) float32 with contiguous tokens; coef (B, G, T, R) float32 with contiguous components
// (views into growable buffers are read in place). Returns sum_t probs[..., t] coef[..., t, :], (B, G, m, R):
// register tiles where the build has AVX-512 and R is a multiple of 16, block_portable() elsewhere.
at::Tensor latent_mix(at::Tensor probs, at::Tensor coef) {
  TORCH_CHECK(probs.scalar_type() == at::kFloat && probs.dim() == 4 && probs.stride(3) == 1 &&
                  probs.device().is_cpu(),
              "probs: expected float32 (B, G, m, T) on the CPU with contiguous tokens");
  TORCH_CHECK(coef.scalar_type() == at::kFloat && coef.dim() == 4 && coef.stride(3) == 1 && coef.device().is_cpu(),
              "coef: expected float32 (B, G, T, R) on the CPU with contiguous components");
  const int64_t b = probs.size(0), g = probs.size(1), m = probs.size(2), t = probs.size(3), r = coef.size(3);
  TORCH_CHECK(coef.size(0) == b && coef.size(1) == g && coef.size(2) == t,
              "coef: expected (B, G, T, R) for the probabilities' B, G and T");
  auto out = at::zeros({b, g, m, r}, probs.options());
  const float* pp = probs.data_ptr<float>();
  const float* cp = coef.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * g, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t xb = lo; xb < hi; ++xb) {
      const int64_t x = xb / g, blk = xb % g;
      const Mix mix{pp + x * probs.stride(0) + blk * probs.stride(1), cp + x * coef.stride(0) + blk * coef.stride(1),
                    op + xb * m * r, probs.stride(2), coef.stride(2), r};
#if defined(__AVX512F__)
      if (r % 16 == 0) {
        block(mix, m, t);
        continue;
      }
#endif
      block_portable(mix, m, t);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_isa", &kvc::vector_isa, "the vector instructions of this build (avx512 or portable)");
  m.def("latent_mix", &latent_mix, "sum_t p[i][t] c[t]: the probabilities' mix of low-rank latents");
}
