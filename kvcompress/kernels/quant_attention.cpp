// Decode attention sums straight from packed KIVI codes, one pass over the bytes per KV head.
// See kvcompress/kernels/__init__.py for the algebra (Liu et al., KIVI, arXiv 2402.02750).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

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

void check(const torch::Tensor& t, at::ScalarType dtype, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous() && t.device().is_cpu(),
              name, ": expected a contiguous CPU tensor of ", dim, " dims and ", dtype);
}

}  // namespace

// q (B, Hk, g, D) float32 (scaled); codes (B, Hk, Te, W) uint8; scale, zero (B, Hk, Te/G, D) float32
// (keys quantized per channel, G tokens a group). Returns the logits (B, Hk, g, Te) float32.
torch::Tensor key_logits(torch::Tensor q, torch::Tensor codes, torch::Tensor scale, torch::Tensor zero,
                         int64_t bits, int64_t group) {
  check(q, at::kFloat, 4, "q");
  check(codes, at::kByte, 4, "codes");
  check(scale, at::kFloat, 4, "scale");
  check(zero, at::kFloat, 4, "zero");
  const int64_t bh = q.size(0) * q.size(1), g = q.size(2), d = q.size(3);
  const int64_t te = codes.size(2), w = codes.size(3), n = te / group;
  TORCH_CHECK(w * (8 / bits) == d && n * group == te && scale.size(2) == n, "key codes: shapes do not fit");
  auto out = torch::empty({q.size(0), q.size(1), g, te}, q.options());
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *zp = zero.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, bh, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(d), qs(g * d), zc(g);
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
        for (int64_t t = m * group; t < (m + 1) * group; ++t) {
          unpack(cp + (x * te + t) * w, w, bits, c.data());
          for (int64_t i = 0; i < g; ++i) {
            const float* qi = qs.data() + i * d;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t e = 0; e < d; ++e) acc += qi[e] * c[e];
            ox[i * te + t] = zc[i] + acc;
          }
        }
      }
    }
  });
  return out;
}

// p (B, Hk, g, Te) float32 probabilities; codes (B, Hk, Te, W) uint8; scale, zero (B, Hk, Te, D/G)
// float32 (values quantized per token, G channels a group). Returns sum_t p_t v_t (B, Hk, g, D) float32.
torch::Tensor value_output(torch::Tensor p, torch::Tensor codes, torch::Tensor scale, torch::Tensor zero,
                           int64_t bits, int64_t group) {
  check(p, at::kFloat, 4, "p");
  check(codes, at::kByte, 4, "codes");
  check(scale, at::kFloat, 4, "scale");
  check(zero, at::kFloat, 4, "zero");
  const int64_t bh = p.size(0) * p.size(1), g = p.size(2), te = p.size(3);
  const int64_t w = codes.size(3), d = w * (8 / bits), ng = d / group;
  TORCH_CHECK(codes.size(2) == te && ng * group == d && scale.size(3) == ng, "value codes: shapes do not fit");
  auto out = torch::empty({p.size(0), p.size(1), g, d}, p.options());
  const float* pp = p.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *zp = zero.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, bh, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(d), acc(g * d), zs(g * ng);
    for (int64_t x = lo; x < hi; ++x) {
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(zs.begin(), zs.end(), 0.f);
      const float* px = pp + x * g * te;
      for (int64_t t = 0; t < te; ++t) {
        unpack(cp + (x * te + t) * w, w, bits, c.data());
        const float* s = sp + (x * te + t) * ng;
        const float* z = zp + (x * te + t) * ng;
        for (int64_t i = 0; i < g; ++i) {  // the token's scales fold into its probability
          const float pi = px[i * te + t];
          float* ai = acc.data() + i * d;
          for (int64_t j = 0; j < ng; ++j) {
            const float ps = pi * s[j];
            zs[i * ng + j] += pi * z[j];
#pragma omp simd
            for (int64_t e = j * group; e < (j + 1) * group; ++e) ai[e] += ps * c[e];
          }
        }
      }
      float* ox = op + x * g * d;
      for (int64_t i = 0; i < g; ++i)
        for (int64_t e = 0; e < d; ++e) ox[i * d + e] = acc[i * d + e] + zs[i * ng + e / group];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("key_logits", &key_logits, "logits of a decode query over KIVI key codes");
  m.def("value_output", &value_output, "probability-weighted sum of KIVI value codes");
}
