// Dot products shared by the kernels: one query with one row (any CPU), and with AVX-512 one query with 16
// rows, ending in one transposing reduction instead of a horizontal sum per row.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvc {

// The vector instructions this build's own loops use ("avx512" or "portable"), bound as ``vector_isa`` by
// every kernel module so that tests can tell which of a kernel's twins they ran.
inline const char* vector_isa() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "portable";
#endif
}

// a . b over d floats (the compiler vectorises it; one horizontal sum at the end).
inline float dot(const float* a, const float* b, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t e = 0; e < d; ++e) acc += a[e] * b[e];
  return acc;
}

// Asks for ``n`` floats from ``p`` on to be brought into L1 ahead of their use. A loop that does much work
// per byte (rebuilding keys from latents) runs too few loads ahead for the hardware prefetcher to hide
// memory latency: a tile's inputs are requested while the tile before it computes.
inline void prefetch(const float* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(float)); off += 64)
    __builtin_prefetch(bytes + off, 0, 3);
}

#if defined(__AVX512F__)

// r[t] = sum of the 16 lanes of a[t], for 16 registers at once (a transpose that adds as it goes).
inline __m512 reduce16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: [a(2i) lo+hi, a(2i+1) lo+hi]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: [a(4i), a(4i+1), a(4i+2), a(4i+3)] 4 lanes each
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // within each quarter: pairs of lanes
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // lane 4q + j of e holds token 4j + q
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// Lane t: q . rows[t], for 16 rows of d floats (d a multiple of 16) stored one after another.
inline __m512 dots16(const float* q, const float* rows, int64_t d) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; e += 16) {
    const __m512 qe = _mm512_loadu_ps(q + e);
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qe, _mm512_loadu_ps(rows + t * d + e), acc[t]);
  }
  return reduce16(acc);
}
#endif

}  // namespace kvc
