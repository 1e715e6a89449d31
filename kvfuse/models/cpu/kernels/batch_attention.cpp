// Batched attention of a few queries per sequence over every running sequence's own KV cache,
// in one call per layer: the CPU kernel behind kvfuse.models.cpu.kernels (its docstring says why).
//
// Each sequence keeps its KV in its own buffer `kv` of shape (layers, 2, kv_heads, capacity,
// head_dim) (float32, float16 or bfloat16) with `positions` (int64, capacity). A query at position
// p sees the keys of slots [0, len) at positions k with k <= p (and p - k < window on sliding
// layers), exactly the mask of kvfuse.models.attention. Keys and values are read in their stored
// dtype and widened to float32 in registers: nothing is converted or copied per call.
//
// Work is split over (query, kv_head) pairs: the query heads of one group read each key row once.
// Where the pairs do not divide evenly between the threads (one decoding sequence: 1 query x a few
// kv heads), each pair's keys are cut into spans too, whose partial softmaxes are merged after
// (flash decoding). Scores are kept for the whole span (two passes: scores, then the
// softmax-weighted sum of values), accumulated in float32.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "parallel.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__F16C__) && defined(__AVX__)
#define KVFUSE_F16C 1
#endif

namespace {

// Widen one row of `d` stored values to float32.
inline void widen(const float* src, float* dst, int64_t d) {
  std::memcpy(dst, src, d * sizeof(float));
}

inline void widen(const at::Half* src, float* dst, int64_t d) {
  int64_t i = 0;
#ifdef KVFUSE_F16C
  for (; i + 8 <= d; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void widen(const at::BFloat16* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  // Four independent 8-wide accumulators: the compiler does not reorder a float reduction itself.
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
         acc3 = _mm256_setzero_ps();
  for (; i + 32 <= d; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  for (; i + 8 <= d; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  s = _mm_cvtss_f32(lo);
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

struct Seq {
  const void* kv;                         // the sequence's whole KV buffer
  const int64_t* positions;               // slot -> position
  int64_t len;                            // valid slots
  int64_t s_layer, s_kv, s_head, s_slot;  // strides of kv (elements)
};

// One (query, kv head) pair over the keys of slots [t0, t1): the group's running maxima `mx`,
// sums of exp(score - max) `sum` and the unnormalized weighted values `out` (group x d), as a
// flash-decoding partial; `merge` combines the partials of a row's spans.
template <typename T>
void attend_span(const Seq& seq, int64_t layer, int64_t g, int64_t group, int64_t d,
                 const float* q_row, int64_t q_head_stride, int64_t q_pos, int64_t window,
                 float scale, float softcap, int64_t t0, int64_t t1, float* mx_out, float* sum_out,
                 float* __restrict out, std::vector<float>& scores, std::vector<float>& row) {
  const T* kbase = static_cast<const T*>(seq.kv) + layer * seq.s_layer + g * seq.s_head;
  const T* vbase = kbase + seq.s_kv;
  const int64_t* positions = seq.positions + t0;
  const int64_t n = std::max<int64_t>(0, t1 - t0);
  scores.resize(n * group);
  row.resize(d);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> mx(group, neg_inf), sum(group, 0.f);
  std::fill(out, out + group * d, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t diff = q_pos - positions[t];
    const bool visible = diff >= 0 && (window <= 0 || diff < window);
    float* st = scores.data() + t * group;
    if (!visible) {
      for (int64_t h = 0; h < group; ++h) st[h] = neg_inf;
      continue;
    }
    widen(kbase + (t0 + t) * seq.s_slot, row.data(), d);
    for (int64_t h = 0; h < group; ++h) {
      float s = dot(q_row + h * q_head_stride, row.data(), d) * scale;
      if (softcap > 0.f) s = std::tanh(s / softcap) * softcap;
      st[h] = s;
      mx[h] = std::max(mx[h], s);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    float* st = scores.data() + t * group;
    if (st[0] == neg_inf) continue;  // a masked key (the whole group shares the query's mask)
    widen(vbase + (t0 + t) * seq.s_slot, row.data(), d);
    for (int64_t h = 0; h < group; ++h) {
      if (mx[h] == neg_inf) continue;
      const float p = std::exp(st[h] - mx[h]);
      sum[h] += p;
      float* o = out + h * d;
      for (int64_t i = 0; i < d; ++i) o[i] += p * row[i];
    }
  }
  std::copy(mx.begin(), mx.end(), mx_out);
  std::copy(sum.begin(), sum.end(), sum_out);
}

// The softmax-weighted values of `parts` partials (maxima, sums, outputs of attend_span) into
// `out` (group x d). A query that sees no key at all gets zeros (SDPA would give NaN; the runner
// never asks).
void merge(int64_t parts, int64_t group, int64_t d, const float* mx, const float* sum,
           const float* outs, float* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < group; ++h) {
    float m = neg_inf;
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, mx[p * group + h]);
    float total = 0.f;
    float* o = out + h * d;
    std::fill(o, o + d, 0.f);
    if (m != neg_inf) {
      for (int64_t p = 0; p < parts; ++p) {
        const float mp = mx[p * group + h];
        if (mp == neg_inf) continue;
        const float w = std::exp(mp - m);
        total += w * sum[p * group + h];
        const float* op = outs + (p * group + h) * d;
        for (int64_t i = 0; i < d; ++i) o[i] += w * op[i];
      }
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

// One span's outputs divided by their sums, in place (zeros where no key was visible).
void normalize(int64_t group, int64_t d, const float* sum, float* out) {
  for (int64_t h = 0; h < group; ++h) {
    const float inv = sum[h] > 0.f ? 1.f / sum[h] : 0.f;
    float* o = out + h * d;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

// Spans per (query, kv head) row: enough that the rows times spans divide evenly between the
// threads (one decoding sequence has fewer rows than threads, or an odd count), each span at
// least kMinSpan keys long; 1 when the rows alone balance.
constexpr int64_t kMinSpan = 64;

int64_t spans_for(int64_t rows, int64_t threads, int64_t longest) {
  if (threads <= 1 || rows <= 0) return 1;
  int64_t a = rows, b = threads;
  while (b != 0) {
    const int64_t r = a % b;
    a = b;
    b = r;
  }
  const int64_t parts = threads / a;  // threads / gcd(rows, threads)
  return std::max<int64_t>(1, std::min(parts, longest / kMinSpan));
}

std::vector<Seq> describe(const std::vector<torch::Tensor>& kvs,
                          const std::vector<torch::Tensor>& positions,
                          const std::vector<int64_t>& lens, at::ScalarType dtype) {
  TORCH_CHECK(kvs.size() == positions.size() && kvs.size() == lens.size(),
              "one kv, positions and length per sequence");
  std::vector<Seq> seqs;
  seqs.reserve(kvs.size());
  for (size_t i = 0; i < kvs.size(); ++i) {
    const auto& kv = kvs[i];
    TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2,
                "kv must be (layers, 2, kv_heads, capacity, head_dim)");
    TORCH_CHECK(kv.scalar_type() == dtype, "every sequence's kv must have the same dtype");
    TORCH_CHECK(kv.stride(4) == 1, "kv rows must be contiguous in head_dim");
    TORCH_CHECK(kv.device().is_cpu() && positions[i].device().is_cpu(),
                "batch_attention runs on the CPU");
    TORCH_CHECK(positions[i].scalar_type() == at::kLong && positions[i].is_contiguous(),
                "positions must be int64");
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= kv.size(3) && lens[i] <= positions[i].numel(),
                "length beyond capacity");
    seqs.push_back(Seq{kv.data_ptr(), positions[i].data_ptr<int64_t>(), lens[i], kv.stride(0),
                       kv.stride(1), kv.stride(2), kv.stride(3)});
  }
  return seqs;
}

}  // namespace

// q: (n, heads, head_dim) float32, head_dim contiguous; q_seq[i]: the sequence of query i;
// q_pos[i]: its position. Returns (n, heads * head_dim) float32.
torch::Tensor attend(torch::Tensor q, std::vector<torch::Tensor> kvs,
                     std::vector<torch::Tensor> positions, std::vector<int64_t> lens,
                     std::vector<int64_t> q_seq, std::vector<int64_t> q_pos, int64_t layer,
                     double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "q must be (n, heads, head_dim) float32");
  TORCH_CHECK(!kvs.empty(), "no sequences");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK((int64_t)q_seq.size() == n && (int64_t)q_pos.size() == n,
              "one sequence index and position per query");
  const auto dtype = kvs[0].scalar_type();
  const auto seqs = describe(kvs, positions, lens, dtype);
  const int64_t kv_heads = kvs[0].size(2);
  TORCH_CHECK(kvs[0].size(4) == d && heads % kv_heads == 0, "q does not match the kv layout");
  TORCH_CHECK(layer >= 0 && layer < kvs[0].size(0), "layer out of range");
  for (auto s : q_seq)
    TORCH_CHECK(s >= 0 && s < (int64_t)seqs.size(), "query of an unknown sequence");
  const int64_t group = heads / kv_heads;
  auto out = torch::empty({n, heads * d}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1);
  int64_t longest = 0;
  for (const Seq& sq : seqs) longest = std::max(longest, sq.len);
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t parts = spans_for(n * kv_heads, threads, longest);
  const int64_t slab = group * d;  // one partial's outputs
  std::vector<float> pmx(n * kv_heads * parts * group), psum(pmx.size());
  std::vector<float> pout(parts > 1 ? n * kv_heads * parts * slab : 0);
  kvf::parallel_for(0, n * kv_heads * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task / parts, part = task % parts;
      const int64_t i = pair / kv_heads, g = pair % kv_heads;
      const Seq& seq = seqs[q_seq[i]];
      const int64_t span = (seq.len + parts - 1) / parts;
      const int64_t t0 = std::min(seq.len, part * span), t1 = std::min(seq.len, t0 + span);
      const float* q_row = qp + i * sq0 + g * group * sq1;
      float* o = parts > 1 ? pout.data() + task * slab : op + i * heads * d + g * group * d;
      float* m = pmx.data() + task * group;
      float* l = psum.data() + task * group;
      const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
      switch (dtype) {
        case at::kFloat:
          attend_span<float>(seq, layer, g, group, d, q_row, sq1, q_pos[i], window, sc, cap, t0, t1,
                             m, l, o, scores, row);
          break;
        case at::kHalf:
          attend_span<at::Half>(seq, layer, g, group, d, q_row, sq1, q_pos[i], window, sc, cap, t0,
                                t1, m, l, o, scores, row);
          break;
        case at::kBFloat16:
          attend_span<at::BFloat16>(seq, layer, g, group, d, q_row, sq1, q_pos[i], window, sc, cap,
                                    t0, t1, m, l, o, scores, row);
          break;
        default:
          TORCH_CHECK(false, "unsupported kv dtype");
      }
      if (parts == 1) normalize(group, d, l, o);
    }
  });
  if (parts > 1) {
    kvf::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t i = pair / kv_heads, g = pair % kv_heads;
        merge(parts, group, d, pmx.data() + pair * parts * group,
              psum.data() + pair * parts * group, pout.data() + pair * parts * slab,
              op + i * heads * d + g * group * d);
      }
    });
  }
  return out;
}

namespace {

inline void narrow_row(const float* src, float* dst, int64_t d) {
  std::memcpy(dst, src, d * sizeof(float));
}

inline void narrow_row(const float* src, at::Half* dst, int64_t d) {
  int64_t i = 0;
#ifdef KVFUSE_F16C
  for (; i + 8 <= d; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < d; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

inline void narrow_row(const float* src, at::BFloat16* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

template <typename T>
void write_rows(torch::Tensor& kv, int64_t layer, const torch::Tensor& k, const torch::Tensor& v,
                int64_t row0, int64_t slot0, int64_t count) {
  const int64_t heads = k.size(1), d = k.size(2);
  T* base = kv.data_ptr<T>() + layer * kv.stride(0);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      T* dk = base + h * kv.stride(2) + (slot0 + r) * kv.stride(3);
      narrow_row(kp + (row0 + r) * k.stride(0) + h * k.stride(1), dk, d);
      narrow_row(vp + (row0 + r) * v.stride(0) + h * v.stride(1), dk + kv.stride(1), d);
    }
  }
}

}  // namespace

// Write the fresh K/V rows of a batched step into each sequence's buffer at `layer`:
// rows [row0[s], row0[s] + count[s]) of k/v (n, kv_heads, head_dim) float32 go to slots
// slot0[s].. of kvs[s], rounded to the buffer's dtype as a tensor copy would (round to nearest).
void write_kv(std::vector<torch::Tensor> kvs, int64_t layer, torch::Tensor k, torch::Tensor v,
              std::vector<int64_t> row0, std::vector<int64_t> slot0, std::vector<int64_t> count) {
  TORCH_CHECK(kvs.size() == row0.size() && kvs.size() == slot0.size() && kvs.size() == count.size(),
              "one span per sequence");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(),
              "k and v must be (n, kv_heads, head_dim)");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.stride(2) == 1 &&
                  v.stride(2) == 1,
              "k and v must be float32 with contiguous rows");
  for (size_t s = 0; s < kvs.size(); ++s) {
    auto& kv = kvs[s];
    TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.stride(4) == 1 && kv.device().is_cpu(),
                "kv layout");
    TORCH_CHECK(kv.size(2) == k.size(1) && kv.size(4) == k.size(2),
                "k/v do not match the kv layout");
    TORCH_CHECK(layer >= 0 && layer < kv.size(0), "layer out of range");
    TORCH_CHECK(row0[s] >= 0 && count[s] >= 0 && row0[s] + count[s] <= k.size(0),
                "rows out of range");
    TORCH_CHECK(slot0[s] >= 0 && slot0[s] + count[s] <= kv.size(3), "slots out of range");
    switch (kv.scalar_type()) {
      case at::kFloat:
        write_rows<float>(kv, layer, k, v, row0[s], slot0[s], count[s]);
        break;
      case at::kHalf:
        write_rows<at::Half>(kv, layer, k, v, row0[s], slot0[s], count[s]);
        break;
      case at::kBFloat16:
        write_rows<at::BFloat16>(kv, layer, k, v, row0[s], slot0[s], count[s]);
        break;
      default:
        TORCH_CHECK(false, "unsupported kv dtype");
    }
  }
}
