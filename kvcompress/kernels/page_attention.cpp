// Decode attention over chosen pages of a float32 KV cache, read where they lie (no gathered copy), and
// the choice of those pages. Quest (Tang et al., arXiv 2406.10774) reads only the pages whose key bounds can
// score high; the tensor form of the choice is in kvcompress/selectors/pages/block_sparse_layer.py, the softmax
// between the two attention calls in torch.
#include "aten.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "vector.h"

namespace {

// Token spans one KV head reads: whole pages[0..k-1) of ``block`` tokens, then [tail, total) of the newest.
struct Spans {
  const int64_t* pages;
  int64_t k, block, total, tail;

  Spans(const int64_t* pages_, int64_t k_, int64_t block_, int64_t total_)
      : pages(pages_), k(k_), block(block_), total(total_), tail((total_ - 1) / block_ * block_) {}
  int64_t tokens() const { return (k - 1) * block + total - tail; }
  int64_t start(int64_t s) const { return s + 1 < k ? pages[s] * block : tail; }
  int64_t length(int64_t s) const { return s + 1 < k ? block : total - tail; }

  // f(at, row) for every token read, ``at`` its index among them, ``row`` its D floats in a head whose
  // tokens are ``stride`` floats apart.
  template <typename F>
  void each_token(const float* head, int64_t stride, F f) const {
    int64_t at = 0;
    for (int64_t s = 0; s < k; ++s) {
      const float* row = head + start(s) * stride;
      for (int64_t t = 0; t < length(s); ++t, ++at, row += stride) f(at, row);
    }
  }
};

// A (B, H_kv, T, D) float32 view whose tokens are rows of D contiguous floats (any strides above).
struct Cache {
  const float* data;
  int64_t sb, sh, st, d;

  Cache(const at::Tensor& x, const char* name) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 4 && x.device().is_cpu() && x.stride(3) == 1,
                name, ": expected a 4-dim float32 CPU tensor with contiguous channels");
    data = x.data_ptr<float>();
    sb = x.stride(0), sh = x.stride(1), st = x.stride(2), d = x.size(3);
  }
  const float* head(int64_t b, int64_t h) const { return data + b * sb + h * sh; }
};

void check_pages(const at::Tensor& pages, int64_t b, int64_t h) {
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 3 && pages.is_contiguous() &&
                  pages.size(0) == b && pages.size(1) == h && pages.size(2) >= 1,
              "pages: expected contiguous int64 (B, H_kv, k >= 1)");
}

}  // namespace

// q (B, H_kv, g, D) float32 contiguous (scaled); keys (B, H_kv, T, D); pages (B, H_kv, k) ascending, the
// newest page last. Returns the logits (B, H_kv, g, n) over the tokens read (``Spans::tokens``).
at::Tensor page_logits(at::Tensor q, at::Tensor keys, at::Tensor pages, int64_t block,
                          int64_t total) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.is_contiguous(), "q: contiguous float32");
  const Cache kc(keys, "keys");
  const int64_t b = q.size(0), hk = q.size(1), g = q.size(2), d = q.size(3), k = pages.size(2);
  check_pages(pages, b, hk);
  TORCH_CHECK(kc.d == d && keys.size(1) == hk && total <= keys.size(2), "keys: shapes do not fit");
  const int64_t n = Spans(pages.data_ptr<int64_t>(), k, block, total).tokens();
  auto out = at::empty({b, hk, g, n}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* pp = pages.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * hk, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      const float* qx = qp + x * g * d;
      float* ox = op + x * g * n;
      const Spans sp(pp + x * k, k, block, total);
      sp.each_token(kc.head(x / hk, x % hk), kc.st, [&](int64_t at, const float* kt) {
        for (int64_t i = 0; i < g; ++i) ox[i * n + at] = kvc::dot(qx + i * d, kt, d);
      });
    }
  });
  return out;
}

// p (B, H_kv, g, n) float32 probabilities over the tokens ``page_logits`` read; values (B, H_kv, T, D).
// Returns sum_t p_t v_t (B, H_kv, g, D) float32.
at::Tensor page_values(at::Tensor p, at::Tensor values, at::Tensor pages, int64_t block,
                          int64_t total) {
  TORCH_CHECK(p.scalar_type() == at::kFloat && p.dim() == 4 && p.is_contiguous(), "p: contiguous float32");
  const Cache vc(values, "values");
  const int64_t b = p.size(0), hk = p.size(1), g = p.size(2), n = p.size(3), k = pages.size(2), d = vc.d;
  check_pages(pages, b, hk);
  const int64_t* gp = pages.data_ptr<int64_t>();
  TORCH_CHECK(n == Spans(gp, k, block, total).tokens() && values.size(1) == hk && total <= values.size(2),
              "values: shapes do not fit");
  auto out = at::zeros({b, hk, g, d}, p.options());
  const float* pp = p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * hk, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      const float* px = pp + x * g * n;
      float* __restrict__ ox = op + x * g * d;
      const Spans sp(gp + x * k, k, block, total);
      sp.each_token(vc.head(x / hk, x % hk), vc.st, [&](int64_t at, const float* vt) {
        for (int64_t i = 0; i < g; ++i) {
          const float w = px[i * n + at];
          float* __restrict__ oi = ox + i * d;
#pragma omp simd
          for (int64_t e = 0; e < d; ++e) oi[e] += w * vt[e];
        }
      });
    }
  });
  return out;
}

// Quest's bound of each page for one KV head's g queries, max over them: per channel q max where q >= 0,
// q min elsewhere (the same sums as kvcompress.selectors.pages.block_sparse_layer.page_bounds), as two dot
// products with the query's positive and negative parts. Pages (P, D); ``parts`` scratch of 2 g D floats.
void bounds(const float* q, int64_t g, int64_t d, const float* lo, const float* hi, int64_t p, float* parts,
            float* out) {
  float* up = parts;  // (g, D): max(q, 0), then min(q, 0)
  float* down = parts + g * d;
  for (int64_t e = 0; e < g * d; ++e) up[e] = std::max(q[e], 0.f), down[e] = std::min(q[e], 0.f);
  std::fill(out, out + p, -std::numeric_limits<float>::infinity());
  int64_t s = 0;
#if defined(__AVX512F__)
  if (d % 16 == 0) {  // 16 pages at a time, one transposing reduction per query part
    for (; s + 16 <= p; s += 16) {
      __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t i = 0; i < g; ++i)
        best = _mm512_max_ps(best, _mm512_add_ps(kvc::dots16(up + i * d, hi + s * d, d),
                                                 kvc::dots16(down + i * d, lo + s * d, d)));
      _mm512_storeu_ps(out + s, best);
    }
  }
#endif
  for (; s < p; ++s)
    for (int64_t i = 0; i < g; ++i)
      out[s] = std::max(out[s], kvc::dot(up + i * d, hi + s * d, d) + kvc::dot(down + i * d, lo + s * d, d));
}

// q (B, H_kv, g, D) float32 contiguous; page_min, page_max (B, H_kv, P, D) float32 with contiguous pages,
// every page holding a token (no padding). Returns the ``width`` pages (B, H_kv, width) int64 ascending
// with the highest bound, the first ``sinks`` pages and the newest one always among them: one call for
// what the tensor form does in a dozen small operations per layer and step.
at::Tensor select_pages(at::Tensor q, at::Tensor page_min, at::Tensor page_max, int64_t sinks,
                           int64_t width) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.is_contiguous(), "q: contiguous float32");
  TORCH_CHECK(page_min.sizes() == page_max.sizes() && page_min.is_contiguous() && page_max.is_contiguous() &&
                  page_min.scalar_type() == at::kFloat && page_max.scalar_type() == at::kFloat,
              "page_min, page_max: contiguous float32 of one shape");
  const int64_t b = q.size(0), hk = q.size(1), g = q.size(2), d = q.size(3), p = page_min.size(2);
  TORCH_CHECK(page_min.size(0) == b && page_min.size(1) == hk && page_min.size(3) == d, "pages: shapes");
  TORCH_CHECK(width >= 1 && width <= p, "width: between 1 and the pages");
  auto out = at::empty({b, hk, width}, q.options().dtype(at::kLong));
  const float *qp = q.data_ptr<float>(), *lo = page_min.data_ptr<float>(), *hi = page_max.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, b * hk, 1, [&](int64_t a, int64_t z) {
    std::vector<float> score(p), parts(2 * g * d);
    std::vector<int64_t> order(p);
    for (int64_t x = a; x < z; ++x) {
      bounds(qp + x * g * d, g, d, lo + x * p * d, hi + x * p * d, p, parts.data(), score.data());
      const float forced = std::numeric_limits<float>::infinity();
      std::fill(score.begin(), score.begin() + std::min(sinks, p), forced);
      score[p - 1] = forced;
      std::iota(order.begin(), order.end(), 0);
      auto better = [&](int64_t i, int64_t j) { return score[i] > score[j] || (score[i] == score[j] && i < j); };
      std::nth_element(order.begin(), order.begin() + (width - 1), order.end(), better);
      std::sort(order.begin(), order.begin() + width);
      std::copy(order.begin(), order.begin() + width, op + x * width);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_isa", &kvc::vector_isa, "the vector instructions of this build (avx512 or portable)");
  m.def("page_logits", &page_logits, "logits of a decode query over chosen pages of a float32 cache");
  m.def("page_values", &page_values, "probability-weighted sum of the values of chosen pages");
  m.def("select_pages", &select_pages, "Quest's pages to read: bounds, forced pages, top width, ascending");
}
