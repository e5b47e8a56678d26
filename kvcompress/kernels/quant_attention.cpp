// Decode attention sums straight from packed KIVI codes, one pass over the bytes per KV head.
// The algebra is in kvcompress/kernels/fused_quant.py (Liu et al., KIVI, arXiv 2402.02750).
#include "aten.h"

#include <vector>

#include "vector.h"

namespace {

constexpr int64_t BLOCK = 16;  // tokens per block of the vector path (floats in a zmm register)

// Codes of one token (W packed bytes, block layout: bits [b*k, b*(k+1)) of byte j hold channel k*W + j)
// as floats c[0..D).
inline void unpack(const uint8_t* bytes, int64_t w, int bits, float* c) {
  const int per = 8 / bits;
  const int mask = (1 << bits) - 1;
  for (int k = 0; k < per; ++k) {
    const int shift = bits * k;
    float* ck = c + k * w;
#pragma omp simd
    for (int64_t j = 0; j < w; ++j) ck[j] = static_cast<float>((bytes[j] >> shift) & mask);
  }
}

#if defined(__AVX512F__)
constexpr int64_t LANES = BLOCK;  // floats in a zmm register; a block of 16 tokens shares one reduction
constexpr int64_t MAX_REGS = 8;  // registers of one head's value sum: head_dim up to 128

// Whether the AVX-512 loops fit: whole registers of channels and of packed bytes.
inline bool wide(int64_t d, int64_t w, int64_t group) {
  return d % LANES == 0 && d <= MAX_REGS * LANES && w % LANES == 0 && group % LANES == 0;
}

// unpack() with vector instructions: 16 bytes at a time, one bit plane per register of floats.
inline void unpack_wide(const uint8_t* bytes, int64_t w, int bits, float* c) {
  const int per = 8 / bits;
  const __m128i mask = _mm_set1_epi8(static_cast<char>((1 << bits) - 1));
  for (int64_t j = 0; j < w; j += LANES) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + j));
    for (int k = 0; k < per; ++k) {
      __m128i v = k ? _mm_srl_epi16(x, _mm_cvtsi32_si128(bits * k)) : x;  // bytes' neighbours masked next
      if (per > 1) v = _mm_and_si128(v, mask);
      _mm512_storeu_ps(c + k * w + j, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)));
    }
  }
}

#endif

void check(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 4 && t.is_contiguous() && t.device().is_cpu(),
              name, ": expected a contiguous 4-dim CPU tensor of ", dtype);
}

// The float input x and the packed codes with their scales and zeros, checked, as raw pointers.
struct Quantized {
  const float* x;
  const uint8_t* codes;
  const float* scale;
  const float* zero;

  Quantized(const at::Tensor& x_, const at::Tensor& codes_, const at::Tensor& scale_,
            const at::Tensor& zero_) {
    check(x_, at::kFloat, "x");
    check(codes_, at::kByte, "codes");
    check(scale_, at::kFloat, "scale");
    check(zero_, at::kFloat, "zero");
    x = x_.data_ptr<float>();
    codes = codes_.data_ptr<uint8_t>();
    scale = scale_.data_ptr<float>();
    zero = zero_.data_ptr<float>();
  }
};

}  // namespace

// acc += sum_t (p_t s_tj) c_t and zs += sum_t p_t z_tj for one KV head's g query heads, one token at a time
// (the token's scales fold into its probability); ``c`` holds a token's D unpacked codes.
inline void values_scalar(const uint8_t* codes, const float* scale, const float* zero, const float* p,
                          int64_t te, int64_t w, int bits, int64_t d, int64_t g, int64_t group, float* c,
                          float* acc, float* zs) {
  const int64_t ng = d / group;
  for (int64_t t = 0; t < te; ++t) {
    unpack(codes + t * w, w, bits, c);
    for (int64_t i = 0; i < g; ++i) {
      const float pi = p[i * te + t];
      float* ai = acc + i * d;
      for (int64_t j = 0; j < ng; ++j) {
        const float ps = pi * scale[t * ng + j];
        zs[i * ng + j] += pi * zero[t * ng + j];
#pragma omp simd
        for (int64_t e = j * group; e < (j + 1) * group; ++e) ai[e] += ps * c[e];
      }
    }
  }
}

#if defined(__AVX512F__)
// Logits of 16 tokens (one key group's, sharing qs and zc) for each of the g query heads: the codes are
// unpacked once into ``block`` (16, D), each head's 16 dot products end in one reduce16.
inline void keys_wide(const uint8_t* bytes, int64_t w, int bits, int64_t d, int64_t g, const float* qs,
                      const float* zc, float* block, float* out, int64_t te) {
  for (int64_t t = 0; t < LANES; ++t) unpack_wide(bytes + t * w, w, bits, block + t * d);
  for (int64_t i = 0; i < g; ++i)
    _mm512_storeu_ps(out + i * te, _mm512_add_ps(kvc::dots16(qs + i * d, block, d), _mm512_set1_ps(zc[i])));
}

// One head's value sum over a block of 16 unpacked tokens, R = D/16 registers (a template, so the running
// sum stays in registers): acc_r += (p_t s_tj) c_t[r] for the value group j of register r.
template <int R>
inline void value_block(const float* pi, const float* scale, int64_t ng, int64_t per_group,
                        const float* block, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_loadu_ps(out + r * LANES);
  for (int64_t t = 0; t < LANES; ++t) {
    const float* st = scale + t * ng;
    const float* bt = block + t * R * LANES;
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(pi[t] * st[r / per_group]), _mm512_loadu_ps(bt + r * LANES),
                               acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * LANES, acc[r]);
}

// acc += sum_t (p_t s_tj) c_t and zs += sum_t p_t z_tj for one KV head's g query heads, 16 tokens at a time:
// each block of codes is unpacked once into ``block``, then every head accumulates it (value_block).
// The buffers never overlap (__restrict__: without it the zero-point sums reload the others, 25% slower).
inline void values_wide(const uint8_t* codes, const float* scale, const float* zero, const float* p,
                        int64_t te, int64_t w, int bits, int64_t d, int64_t g, int64_t group,
                        float* __restrict__ block, float* __restrict__ acc, float* __restrict__ zs) {
  const int64_t ng = d / group, per_group = group / LANES;
  for (int64_t t0 = 0; t0 < te; t0 += LANES) {
    for (int64_t t = 0; t < LANES; ++t) unpack_wide(codes + (t0 + t) * w, w, bits, block + t * d);
    const float* st = scale + t0 * ng;
    for (int64_t i = 0; i < g; ++i) {
      const float* pi = p + i * te + t0;
      float* ai = acc + i * d;
      switch (d / LANES) {
        case 1: value_block<1>(pi, st, ng, per_group, block, ai); break;
        case 2: value_block<2>(pi, st, ng, per_group, block, ai); break;
        case 3: value_block<3>(pi, st, ng, per_group, block, ai); break;
        case 4: value_block<4>(pi, st, ng, per_group, block, ai); break;
        case 5: value_block<5>(pi, st, ng, per_group, block, ai); break;
        case 6: value_block<6>(pi, st, ng, per_group, block, ai); break;
        case 7: value_block<7>(pi, st, ng, per_group, block, ai); break;
        default: value_block<8>(pi, st, ng, per_group, block, ai); break;
      }
      for (int64_t t = 0; t < LANES; ++t)
        for (int64_t j = 0; j < ng; ++j) zs[i * ng + j] += pi[t] * zero[(t0 + t) * ng + j];
    }
  }
}
#endif

// q (B, Hk, g, D) float32 (scaled); codes (B, Hk, Te, W) uint8; scale, zero (B, Hk, Te/G, D) float32
// (keys quantized per channel, G tokens a group). Returns the logits (B, Hk, g, Te) float32.
at::Tensor key_logits(at::Tensor q, at::Tensor codes, at::Tensor scale, at::Tensor zero,
                         int64_t bits, int64_t group) {
  const Quantized in(q, codes, scale, zero);
  const float *qp = in.x, *sp = in.scale, *zp = in.zero;
  const uint8_t* cp = in.codes;
  const int64_t bh = q.size(0) * q.size(1), g = q.size(2), d = q.size(3);
  const int64_t te = codes.size(2), w = codes.size(3), n = te / group;
  TORCH_CHECK(w * (8 / bits) == d && n * group == te && scale.size(2) == n, "key codes: shapes do not fit");
  auto out = at::empty({q.size(0), q.size(1), g, te}, q.options());
  float* op = out.data_ptr<float>();
#if defined(__AVX512F__)
  const bool fast = wide(d, w, group);
#endif
  at::parallel_for(0, bh, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(d), qs(g * d), zc(g), block(BLOCK * d);
    for (int64_t x = lo; x < hi; ++x) {
      const float* qx = qp + x * g * d;
      float* ox = op + x * g * te;
      for (int64_t m = 0; m < n; ++m) {
        const float* s = sp + (x * n + m) * d;
        const float* z = zp + (x * n + m) * d;
        for (int64_t i = 0; i < g; ++i) {  // the group's scales fold into the query, zeros into a constant
          float acc = 0.f;
          for (int64_t e = 0; e < d; ++e) {
            qs[i * d + e] = qx[i * d + e] * s[e];
            acc += qx[i * d + e] * z[e];
          }
          zc[i] = acc;
        }
#if defined(__AVX512F__)
        if (fast) {
          for (int64_t t0 = m * group; t0 < (m + 1) * group; t0 += LANES)
            keys_wide(cp + (x * te + t0) * w, w, bits, d, g, qs.data(), zc.data(), block.data(), ox + t0, te);
          continue;
        }
#endif
        for (int64_t t = m * group; t < (m + 1) * group; ++t) {
          unpack(cp + (x * te + t) * w, w, bits, c.data());
          for (int64_t i = 0; i < g; ++i) ox[i * te + t] = zc[i] + kvc::dot(qs.data() + i * d, c.data(), d);
        }
      }
    }
  });
  return out;
}

// q (B, Hk, g, D) float32 (scaled); codes (B, Hk, Te, W) uint8; scale, zero (B, Hk, Te, D/G) float32 (keys
// quantized per token, G channels a group, as values are). Returns the logits (B, Hk, g, Te) float32:
// q . k_t = sum_j s_tj (q_j . c_tj) + sum_j z_tj sum(q_j), q_j the query's channels of group j.
at::Tensor key_logits_token(at::Tensor q, at::Tensor codes, at::Tensor scale, at::Tensor zero,
                            int64_t bits, int64_t group) {
  const Quantized in(q, codes, scale, zero);
  const float *qp = in.x, *sp = in.scale, *zp = in.zero;
  const uint8_t* cp = in.codes;
  const int64_t bh = q.size(0) * q.size(1), g = q.size(2), d = q.size(3);
  const int64_t te = codes.size(2), w = codes.size(3), ng = d / group;
  TORCH_CHECK(w * (8 / bits) == d && ng * group == d && scale.size(2) == te && scale.size(3) == ng,
              "token key codes: shapes do not fit");
  auto out = at::empty({q.size(0), q.size(1), g, te}, q.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, bh, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(d), qsum(g * ng);
    for (int64_t x = lo; x < hi; ++x) {
      const float* qx = qp + x * g * d;
      float* ox = op + x * g * te;
      for (int64_t i = 0; i < g; ++i)  // each group's query sum meets its zero point
        for (int64_t j = 0; j < ng; ++j) {
          float acc = 0.f;
          for (int64_t e = j * group; e < (j + 1) * group; ++e) acc += qx[i * d + e];
          qsum[i * ng + j] = acc;
        }
      for (int64_t t = 0; t < te; ++t) {
        unpack(cp + (x * te + t) * w, w, bits, c.data());
        const float* s = sp + (x * te + t) * ng;
        const float* z = zp + (x * te + t) * ng;
        for (int64_t i = 0; i < g; ++i) {
          float acc = 0.f;
          for (int64_t j = 0; j < ng; ++j) {
            const float dj = kvc::dot(qx + i * d + j * group, c.data() + j * group, group);
            acc += s[j] * dj + z[j] * qsum[i * ng + j];
          }
          ox[i * te + t] = acc;
        }
      }
    }
  });
  return out;
}

// p (B, Hk, g, Te) float32 probabilities; codes (B, Hk, Te, W) uint8; scale, zero (B, Hk, Te, D/G)
// float32 (values quantized per token, G channels a group). Returns sum_t p_t v_t (B, Hk, g, D) float32.
at::Tensor value_output(at::Tensor p, at::Tensor codes, at::Tensor scale, at::Tensor zero,
                           int64_t bits, int64_t group) {
  const Quantized in(p, codes, scale, zero);
  const float *pp = in.x, *sp = in.scale, *zp = in.zero;
  const uint8_t* cp = in.codes;
  const int64_t bh = p.size(0) * p.size(1), g = p.size(2), te = p.size(3);
  const int64_t w = codes.size(3), d = w * (8 / bits), ng = d / group;
  TORCH_CHECK(codes.size(2) == te && ng * group == d && scale.size(3) == ng,
              "value codes: shapes do not fit");
  auto out = at::empty({p.size(0), p.size(1), g, d}, p.options());
  float* op = out.data_ptr<float>();
#if defined(__AVX512F__)
  const bool fast = wide(d, w, group) && te % LANES == 0;
#endif
  at::parallel_for(0, bh, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(d), acc(g * d), zs(g * ng), block(BLOCK * d);
    for (int64_t x = lo; x < hi; ++x) {
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(zs.begin(), zs.end(), 0.f);
      const float* px = pp + x * g * te;
      const uint8_t* cx = cp + x * te * w;
      const float *sx = sp + x * te * ng, *zx = zp + x * te * ng;
#if defined(__AVX512F__)
      if (fast)
        values_wide(cx, sx, zx, px, te, w, bits, d, g, group, block.data(), acc.data(), zs.data());
      else
#endif
        values_scalar(cx, sx, zx, px, te, w, bits, d, g, group, c.data(), acc.data(), zs.data());
      float* ox = op + x * g * d;
      for (int64_t i = 0; i < g; ++i)
        for (int64_t e = 0; e < d; ++e) ox[i * d + e] = acc[i * d + e] + zs[i * ng + e / group];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_isa", &kvc::vector_isa, "the vector instructions of this build (avx512 or portable)");
  m.def("key_logits", &key_logits, "logits of a decode query over KIVI key codes");
  m.def("key_logits_token", &key_logits_token, "logits of a decode query over per-token key codes");
  m.def("value_output", &value_output, "probability-weighted sum of KIVI value codes");
}
