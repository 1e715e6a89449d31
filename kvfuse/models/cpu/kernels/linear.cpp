// Projections of a decode step, y = x @ W^T (+ bias), for float32 and int8 weights laid out in
// blocks of 16 output channels: the CPU kernel behind kvfuse.models.packed.BlockedWeight (see
// its docstring for why).
//
// Layout. A (out, in) weight is stored as (ceil(out / 16), in, 16): block b holds output channels
// 16b..16b+15, and for each input index k their 16 weights side by side. One block is one
// contiguous stream of memory, read once per call whatever the number of rows; its last block is
// zero-padded. int8 weights carry one float32 scale per output channel (symmetric, per-channel
// quantization) and are widened to float32 in registers: activations are never rounded.
//
// Work. Threads split the blocks (kvf::parallel_for, parallel.h; the extension is built with OpenMP
// so that it uses PyTorch's threads). One row (a single-stream decode step) is a bandwidth-bound
// dot product of the block with x, eight accumulators deep. More rows are copied into panels of 6
// rows, k-major, and each (6 rows x 16 channels) tile is accumulated in twelve registers over a
// chunk of k that stays in L1 while every panel of the row chunk uses it (the classic register
// blocking of a GEMM micro-kernel, with the weight as the streamed operand). Accumulation is in
// float32, k ascending within a chunk: results equal F.linear's up to float rounding.

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parallel.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVFUSE_AVX2 1
#endif

namespace {

constexpr int64_t NB = 16;  // output channels per block
constexpr int64_t MR = 6;   // rows per register tile
constexpr int64_t MC = 48;  // rows whose panels stay in L2 while a thread walks its blocks

// k per chunk: small enough that a block's chunk stays in L1 while the few panels of a decode
// step reuse it, longer for many rows (fewer passes over the output tile). Measured on SmolLM2's
// and Qwen2.5's shapes, 2 cores.
inline int64_t k_chunk(int64_t rows) { return rows <= 32 ? 128 : 512; }

#ifdef KVFUSE_AVX2
inline void load16(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
inline void load16(const int8_t* p, __m256& a, __m256& b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
}

// c[r][0:16] (+)= sum_k x[k * MR + r] * w[k][0:16] for r < R (x a packed panel). Twelve named
// accumulators: with an array of them GCC keeps a copy on the stack and stores it every step.
#define KVF_ROW(r)                                 \
  if constexpr (R > r) {                           \
    const __m256 xr = _mm256_broadcast_ss(xk + r); \
    a##r##0 = _mm256_fmadd_ps(u, xr, a##r##0);     \
    a##r##1 = _mm256_fmadd_ps(v, xr, a##r##1);     \
  }
#define KVF_OUT(r)                                                       \
  if constexpr (R > r) {                                                 \
    if (!first) {                                                        \
      a##r##0 = _mm256_add_ps(a##r##0, _mm256_loadu_ps(c + r * NB));     \
      a##r##1 = _mm256_add_ps(a##r##1, _mm256_loadu_ps(c + r * NB + 8)); \
    }                                                                    \
    _mm256_storeu_ps(c + r * NB, a##r##0);                               \
    _mm256_storeu_ps(c + r * NB + 8, a##r##1);                           \
  }
template <typename T, int R>
inline void tile(const T* w, int64_t kc, const float* x, float* c, bool first, const T* ahead) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t k = 0; k < kc; ++k) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * NB), _MM_HINT_T0);
    __m256 u, v;
    load16(w + k * NB, u, v);
    const float* xk = x + k * MR;
    KVF_ROW(0) KVF_ROW(1) KVF_ROW(2) KVF_ROW(3) KVF_ROW(4) KVF_ROW(5)
  }
  KVF_OUT(0) KVF_OUT(1) KVF_OUT(2) KVF_OUT(3) KVF_OUT(4) KVF_OUT(5)
}
#undef KVF_ROW
#undef KVF_OUT

// One row over a whole block: four independent accumulator pairs hide the FMA latency.
template <typename T>
inline void row(const T* w, int64_t in, const float* x, float* c) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= in; k += 4) {
    for (int j = 0; j < 4; ++j) {
      __m256 u, v;
      load16(w + (k + j) * NB, u, v);
      const __m256 xr = _mm256_broadcast_ss(x + k + j);
      a[2 * j] = _mm256_fmadd_ps(u, xr, a[2 * j]);
      a[2 * j + 1] = _mm256_fmadd_ps(v, xr, a[2 * j + 1]);
    }
  }
  for (; k < in; ++k) {
    __m256 u, v;
    load16(w + k * NB, u, v);
    const __m256 xr = _mm256_broadcast_ss(x + k);
    a[0] = _mm256_fmadd_ps(u, xr, a[0]);
    a[1] = _mm256_fmadd_ps(v, xr, a[1]);
  }
  _mm256_storeu_ps(c, _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6])));
  _mm256_storeu_ps(c + 8, _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7])));
}

// ``ahead``: the weights of the next chunk, fetched into L1 while this panel computes from the
// current one (the first panel of a chunk waits for memory, the others do not: without this the
// stream and the arithmetic take turns instead of overlapping). Null: nothing to fetch.
template <typename T>
inline void panel(const T* w, int64_t kc, const float* x, int64_t rows, float* c, bool first,
                  const T* ahead) {
  switch (rows) {
    case 6:
      tile<T, 6>(w, kc, x, c, first, ahead);
      break;
    case 5:
      tile<T, 5>(w, kc, x, c, first, ahead);
      break;
    case 4:
      tile<T, 4>(w, kc, x, c, first, ahead);
      break;
    case 3:
      tile<T, 3>(w, kc, x, c, first, ahead);
      break;
    case 2:
      tile<T, 2>(w, kc, x, c, first, ahead);
      break;
    default:
      tile<T, 1>(w, kc, x, c, first, ahead);
      break;
  }
}

// int8 -> float32 once per chunk when several panels reuse it.
inline void widen_chunk(const int8_t* w, int64_t kc, float* out) {
  for (int64_t k = 0; k < kc; ++k) {
    __m256 u, v;
    load16(w + k * NB, u, v);
    _mm256_storeu_ps(out + k * NB, u);
    _mm256_storeu_ps(out + k * NB + 8, v);
  }
}
#else
// Portable versions (no AVX2/FMA): the same arithmetic, one lane at a time.
template <typename T>
inline void row(const T* w, int64_t in, const float* x, float* c) {
  for (int64_t j = 0; j < NB; ++j) c[j] = 0.f;
  for (int64_t k = 0; k < in; ++k)
    for (int64_t j = 0; j < NB; ++j) c[j] += static_cast<float>(w[k * NB + j]) * x[k];
}
template <typename T>
inline void panel(const T* w, int64_t kc, const float* x, int64_t rows, float* c, bool first,
                  const T*) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[NB] = {0.f};
    for (int64_t k = 0; k < kc; ++k)
      for (int64_t j = 0; j < NB; ++j) acc[j] += static_cast<float>(w[k * NB + j]) * x[k * MR + r];
    for (int64_t j = 0; j < NB; ++j) c[r * NB + j] = first ? acc[j] : c[r * NB + j] + acc[j];
  }
}
inline void widen_chunk(const int8_t* w, int64_t kc, float* out) {
  for (int64_t i = 0; i < kc * NB; ++i) out[i] = static_cast<float>(w[i]);
}
#endif

// x (n, in) as panels of MR rows, k-major, the last one zero-padded.
std::vector<float> panels_of(const float* x, int64_t n, int64_t in) {
  const int64_t panels = (n + MR - 1) / MR;
  std::vector<float> out(panels * in * MR, 0.f);
  for (int64_t r = 0; r < n; ++r) {
    float* dst = out.data() + (r / MR) * in * MR + (r % MR);
    const float* src = x + r * in;
    for (int64_t k = 0; k < in; ++k) dst[k * MR] = src[k];
  }
  return out;
}

template <typename T>
void run(const float* x, int64_t n, int64_t in, const T* w, int64_t nblocks, int64_t out,
         const float* scales, const float* bias, float* y) {
  const int64_t kc_max = k_chunk(n);
  const std::vector<float> packed = n > 1 ? panels_of(x, n, in) : std::vector<float>();
  kvf::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> c(MC * NB);
    std::vector<float> wide(std::is_same<T, float>::value || n <= MR ? 0 : kc_max * NB);
    for (int64_t m0 = 0; m0 < n; m0 += MC) {
      const int64_t mrows = std::min(MC, n - m0), p0 = m0 / MR, pn = (mrows + MR - 1) / MR;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const T* wb = w + blk * in * NB;
        if (n == 1) {
          row<T>(wb, in, x, c.data());
        } else {
          for (int64_t k0 = 0; k0 < in; k0 += kc_max) {
            const int64_t kc = std::min(kc_max, in - k0);
            // the next chunk: the rest of this block, else the start of the thread's next block
            const T* next =
                k0 + kc < in ? wb + (k0 + kc) * NB : (blk + 1 < b1 ? wb + in * NB : nullptr);
            for (int64_t p = p0; p < p0 + pn; ++p) {
              const float* xp = packed.data() + p * in * MR + k0 * MR;
              float* cp = c.data() + (p - p0) * MR * NB;
              const int64_t rows = std::min(MR, n - p * MR);
              const T* ahead = p == p0 + 1 ? next : nullptr;
              if (!wide.empty()) {
                if (p == p0)
                  widen_chunk(reinterpret_cast<const int8_t*>(wb) + k0 * NB, kc, wide.data());
                panel<float>(wide.data(), kc, xp, rows, cp, k0 == 0, nullptr);
                if (ahead)
                  for (int64_t k = 0; k < kc; k += 4) __builtin_prefetch(ahead + k * NB);
              } else {
                panel<T>(wb + k0 * NB, kc, xp, rows, cp, k0 == 0, ahead);
              }
            }
          }
        }
        const int64_t c0 = blk * NB, cn = std::min(NB, out - c0);
        for (int64_t r = 0; r < mrows; ++r) {
          float* dst = y + (m0 + r) * out + c0;
          const float* src = c.data() + r * NB;
          for (int64_t j = 0; j < cn; ++j) {
            float v = src[j];
            if (scales) v *= scales[c0 + j];
            if (bias) v += bias[c0 + j];
            dst[j] = v;
          }
        }
      }
    }
  });
}

torch::Tensor blocks_of(const torch::Tensor& w) {
  const int64_t out = w.size(0), in = w.size(1), nb = (out + NB - 1) / NB;
  auto padded = torch::zeros({nb * NB, in}, w.options());
  padded.narrow(0, 0, out).copy_(w);
  return padded.view({nb, NB, in}).transpose(1, 2).contiguous();
}

}  // namespace

torch::Tensor pack_linear(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack_linear needs a 2-d float32 CPU weight");
  return blocks_of(w.contiguous());
}

std::vector<torch::Tensor> pack_linear_int8(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.is_floating_point(),
              "pack_linear_int8 needs a 2-d floating CPU weight");
  auto wf = w.to(at::kFloat).contiguous();
  auto scale = wf.abs().amax(1).div(127.0).clamp_min(1e-12);
  auto q = wf.div(scale.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar);
  return {blocks_of(q), scale.contiguous()};
}

torch::Tensor blocked_linear(torch::Tensor x, torch::Tensor blocks, int64_t out,
                             c10::optional<torch::Tensor> scales,
                             c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be (n, in) float32 on the CPU");
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == NB && blocks.is_contiguous(),
              "blocks must be (nblocks, in, 16)");
  TORCH_CHECK(blocks.size(1) == x.size(1), "x has ", x.size(1), " features, the weight expects ",
              blocks.size(1));
  TORCH_CHECK(out > 0 && out <= blocks.size(0) * NB && out > (blocks.size(0) - 1) * NB,
              "out does not match the blocks");
  const bool int8 = blocks.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || blocks.scalar_type() == at::kFloat, "blocks must be float32 or int8");
  TORCH_CHECK(int8 == scales.has_value(),
              "int8 blocks need their scales (and float32 blocks none)");
  if (scales)
    TORCH_CHECK(
        scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->numel() == out,
        "scales: (out,) float32");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out,
                "bias: (out,) float32");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), out}, x.options());
  if (x.size(0) == 0) return y;
  const float* s = scales ? scales->data_ptr<float>() : nullptr;
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (int8)
    run<int8_t>(x.data_ptr<float>(), x.size(0), x.size(1), blocks.data_ptr<int8_t>(),
                blocks.size(0), out, s, b, y.data_ptr<float>());
  else
    run<float>(x.data_ptr<float>(), x.size(0), x.size(1), blocks.data_ptr<float>(), blocks.size(0),
               out, s, b, y.data_ptr<float>());
  return y;
}
