// The small per-row operations of a decode step, one call each: RMSNorm (with the residual add
// before it), the gated MLP activation and the rotary embedding. PyTorch runs each as several
// operators (F.rms_norm alone was ~44 us for one 576-wide row on the development machine, about
// 2.7 ms of a 30-layer SmolLM2 step); here each is one pass over the row.
//
// Float32 only, rows with a contiguous last dimension; the callers (kvfuse.models.pointwise)
// keep PyTorch's expressions for anything else. Results equal PyTorch's up to float rounding
// (sums of squares are accumulated in double).

#include <cmath>

#include "kernels.h"
#include "parallel.h"

namespace {

// Rows of a tensor whose last dimension is contiguous: (rows, d) with a row stride, or
// (n, heads, d) with two strides.
struct Rows {
  const float* base;
  int64_t n1, n2, s1, s2, d;
  const float* row(int64_t i) const { return base + (i / n2) * s1 + (i % n2) * s2; }
  int64_t count() const { return n1 * n2; }
};

Rows rows_of(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), name,
              " must be float32 on the CPU");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, name, " must be (n, d) or (n, heads, d)");
  TORCH_CHECK(x.stride(-1) == 1, name, "'s last dimension must be contiguous");
  if (x.dim() == 2) return Rows{x.data_ptr<float>(), x.size(0), 1, x.stride(0), 0, x.size(1)};
  return Rows{x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), x.stride(1), x.size(2)};
}

inline void norm_row(const float* x, const float* w, float eps, int64_t d, float* y) {
  double ss = 0.0;
  for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / d + eps));
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * inv * w[i];
}

void check_weight(const torch::Tensor& w, int64_t d) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == d,
              "the norm weight must be (", d, ",) float32");
}

}  // namespace

// RMSNorm of every row: y = x / sqrt(mean(x^2) + eps) * w; y has x's shape, contiguous.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const Rows r = rows_of(x, "x");
  check_weight(w, r.d);
  auto y = torch::empty(x.sizes(), x.options());
  float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  kvf::parallel_for(0, r.count(), 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      norm_row(r.row(i), wp, static_cast<float>(eps), r.d, yp + i * r.d);
  });
  return y;
}

// The residual add then the next norm: returns (h + delta, rms_norm(h + delta)).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor delta, torch::Tensor w,
                                        double eps) {
  TORCH_CHECK(h.dim() == 2 && h.sizes() == delta.sizes(),
              "h and delta must be (n, d) of the same shape");
  const Rows rh = rows_of(h, "h"), rd = rows_of(delta, "delta");
  check_weight(w, rh.d);
  auto sum = torch::empty(h.sizes(), h.options());
  auto y = torch::empty(h.sizes(), h.options());
  float* sp = sum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  kvf::parallel_for(0, rh.count(), 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* a = rh.row(i);
      const float* c = rd.row(i);
      float* s = sp + i * rh.d;
      for (int64_t j = 0; j < rh.d; ++j) s[j] = a[j] + c[j];
      norm_row(s, wp, static_cast<float>(eps), rh.d, yp + i * rh.d);
    }
  });
  return {sum, y};
}

// The gated MLP activation of gate and up (n, inter) (two column ranges of one product, say):
// act(gate) * up, act = silu (0) or the tanh approximation of gelu (1).
torch::Tensor gated_act(torch::Tensor gate, torch::Tensor up, int64_t act) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes(),
              "gate and up must be (n, inter) of the same shape");
  TORCH_CHECK(act == 0 || act == 1, "act: 0 (silu) or 1 (gelu, tanh)");
  const Rows rg = rows_of(gate, "gate"), ru = rows_of(up, "up");
  auto y = torch::empty(gate.sizes(), gate.options());
  float* yp = y.data_ptr<float>();
  const int64_t d = rg.d;
  kvf::parallel_for(0, rg.count(), 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* g = rg.row(i);
      const float* u = ru.row(i);
      float* o = yp + i * d;
      if (act == 0) {
        for (int64_t j = 0; j < d; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
      } else {
        constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
        for (int64_t j = 0; j < d; ++j) {
          const float v = g[j];
          o[j] = 0.5f * v * (1.f + std::tanh(k * (v + 0.044715f * v * v * v))) * u[j];
        }
      }
    }
  });
  return y;
}

// Rotary embedding of x (n, heads, head_dim) in the "rotate half" layout: dims i and i + half
// rotate by the angle of row n's position; dims past 2 * half (partial rotary) are copied.
// cos/sin: (n, half) float32, contiguous.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3, "x must be (n, heads, head_dim)");
  const Rows r = rows_of(x, "x");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "cos and sin must be (n, half) float32, contiguous");
  const int64_t half = cos.size(1), d = r.d;
  TORCH_CHECK(2 * half <= d, "the rotated dims exceed head_dim");
  auto y = torch::empty(x.sizes(), x.options());
  float* yp = y.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  kvf::parallel_for(0, r.count(), 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* v = r.row(i);
      const float* c = cp + (i / r.n2) * half;
      const float* s = sp + (i / r.n2) * half;
      float* o = yp + i * d;
      for (int64_t j = 0; j < half; ++j) {
        o[j] = v[j] * c[j] - v[j + half] * s[j];
        o[j + half] = v[j + half] * c[j] + v[j] * s[j];
      }
      for (int64_t j = 2 * half; j < d; ++j) o[j] = v[j];
    }
  });
  return y;
}
