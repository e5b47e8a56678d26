// Decode attention over chosen pages of a float32 KV cache, read where they lie (no gathered copy).
// Quest (Tang et al., arXiv 2406.10774) reads only the pages whose key bounds can score high; the page
// choice is in kvcompress/policies/block_sparse_layer.py, the softmax between the two calls in torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

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

  Cache(const torch::Tensor& x, const char* name) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 4 && x.device().is_cpu() && x.stride(3) == 1,
                name, ": expected a 4-dim float32 CPU tensor with contiguous channels");
    data = x.data_ptr<float>();
    sb = x.stride(0), sh = x.stride(1), st = x.stride(2), d = x.size(3);
  }
  const float* head(int64_t b, int64_t h) const { return data + b * sb + h * sh; }
};

void check_pages(const torch::Tensor& pages, int64_t b, int64_t h) {
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 3 && pages.is_contiguous() &&
                  pages.size(0) == b && pages.size(1) == h && pages.size(2) >= 1,
              "pages: expected contiguous int64 (B, H_kv, k >= 1)");
}

}  // namespace

// q (B, H_kv, g, D) float32 contiguous (scaled); keys (B, H_kv, T, D); pages (B, H_kv, k) ascending, the
// newest page last. Returns the logits (B, H_kv, g, n) over the tokens read (``Spans::tokens``).
torch::Tensor page_logits(torch::Tensor q, torch::Tensor keys, torch::Tensor pages, int64_t block,
                          int64_t total) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.is_contiguous(), "q: contiguous float32");
  const Cache kc(keys, "keys");
  const int64_t b = q.size(0), hk = q.size(1), g = q.size(2), d = q.size(3), k = pages.size(2);
  check_pages(pages, b, hk);
  TORCH_CHECK(kc.d == d && keys.size(1) == hk && total <= keys.size(2), "keys: shapes do not fit");
  const int64_t n = Spans(pages.data_ptr<int64_t>(), k, block, total).tokens();
  auto out = torch::empty({b, hk, g, n}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* pp = pages.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * hk, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      const float* qx = qp + x * g * d;
      float* ox = op + x * g * n;
      const Spans sp(pp + x * k, k, block, total);
      sp.each_token(kc.head(x / hk, x % hk), kc.st, [&](int64_t at, const float* kt) {
        for (int64_t i = 0; i < g; ++i) {
          const float* qi = qx + i * d;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t e = 0; e < d; ++e) acc += qi[e] * kt[e];
          ox[i * n + at] = acc;
        }
      });
    }
  });
  return out;
}

// p (B, H_kv, g, n) float32 probabilities over the tokens ``page_logits`` read; values (B, H_kv, T, D).
// Returns sum_t p_t v_t (B, H_kv, g, D) float32.
torch::Tensor page_values(torch::Tensor p, torch::Tensor values, torch::Tensor pages, int64_t block,
                          int64_t total) {
  TORCH_CHECK(p.scalar_type() == at::kFloat && p.dim() == 4 && p.is_contiguous(), "p: contiguous float32");
  const Cache vc(values, "values");
  const int64_t b = p.size(0), hk = p.size(1), g = p.size(2), n = p.size(3), k = pages.size(2), d = vc.d;
  check_pages(pages, b, hk);
  const int64_t* gp = pages.data_ptr<int64_t>();
  TORCH_CHECK(n == Spans(gp, k, block, total).tokens() && values.size(1) == hk && total <= values.size(2),
              "values: shapes do not fit");
  auto out = torch::zeros({b, hk, g, d}, p.options());
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("page_logits", &page_logits, "logits of a decode query over chosen pages of a float32 cache");
  m.def("page_values", &page_values, "probability-weighted sum of the values of chosen pages");
}
