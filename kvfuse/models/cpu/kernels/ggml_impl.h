// The GGUF weight kernels for one instruction set, included once per set by ggml_avx2.cpp and
// ggml_avx512.cpp after their `#pragma GCC target` (see ggml_ops.h for why nothing here may have
// external linkage but the one table function, KVF_OPS_FN).
//
// Dequantization follows ggml's reference code (ggml-quants.c, dequantize_row_*) block by block,
// in float32: a value is d * q (+ m), with the sub-block scales of the K types unpacked first, so
// the products equal those of the weight dequantized to float32 up to float rounding. Each type
// is one visitor that unpacks a block a vector of values at a time and hands every vector to an
// emitter: a store (dequantization into a buffer), or multiply-adds into the rows of x (a decode
// step's products, nothing stored between the unpacking and the arithmetic).
//
// Include with KVF_AVX512 defined to 0 or 1 and KVF_OPS_FN the table function's name.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "ggml_ops.h"

namespace {

using kvf::BlockShape;
using kvf::QuantProduct;

inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ------------------------------------------------------------------------------ vector helpers

#if KVF_AVX512
using Vec = __m512;
using IVec = __m512i;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float f) { return _mm512_set1_ps(f); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
// kLanes bytes from p, zero- or sign-extended to int32 lanes
inline IVec load_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec load_i8(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec to_f(IVec v) { return _mm512_cvtepi32_ps(v); }
inline IVec iset(int v) { return _mm512_set1_epi32(v); }
inline IVec iand(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec ior(IVec a, IVec b) { return _mm512_or_si512(a, b); }
inline IVec isub(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec ishl(IVec a, IVec b) { return _mm512_sllv_epi32(a, b); }
inline IVec ishr(IVec a, IVec b) { return _mm512_srlv_epi32(a, b); }
inline IVec iota() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
// kLanes fp16 / bf16 values from p
inline Vec load_f16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec load_bf16(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
constexpr int kTileRows = 4, kTileCols = 4;  // many_rows' register tile: 16 accumulators
#else
using Vec = __m256;
using IVec = __m256i;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float f) { return _mm256_set1_ps(f); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline IVec load_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline IVec load_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline Vec to_f(IVec v) { return _mm256_cvtepi32_ps(v); }
inline IVec iset(int v) { return _mm256_set1_epi32(v); }
inline IVec iand(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec ior(IVec a, IVec b) { return _mm256_or_si256(a, b); }
inline IVec isub(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec ishl(IVec a, IVec b) { return _mm256_sllv_epi32(a, b); }
inline IVec ishr(IVec a, IVec b) { return _mm256_srlv_epi32(a, b); }
inline IVec iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline Vec load_f16(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec load_bf16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
constexpr int kTileRows = 3, kTileCols = 4;  // 12 accumulators + 3 rows of x + 1 of the weight
#endif

// ------------------------------------------------------------------ one visitor per GGML type
// visit(block, emit) calls emit(offset, values) for every kLanes values of the block, in order.

#define KVF_UNROLL _Pragma("GCC unroll 16")

template <class E>
inline void q4_0(const uint8_t* b, E& emit) {
  const Vec d = vset(half(b));
  const IVec lo = iset(15), four = iset(4), eight = iset(8);
  KVF_UNROLL for (int j = 0; j < 16; j += kLanes) {
    const IVec v = load_u8(b + 2 + j);
    emit(j, vmul(to_f(isub(iand(v, lo), eight)), d));
    emit(j + 16, vmul(to_f(isub(ishr(v, four), eight)), d));
  }
}

template <class E>
inline void q4_1(const uint8_t* b, E& emit) {
  const Vec d = vset(half(b)), m = vset(half(b + 2));
  const IVec lo = iset(15), four = iset(4);
  KVF_UNROLL for (int j = 0; j < 16; j += kLanes) {
    const IVec v = load_u8(b + 4 + j);
    emit(j, vfma(to_f(iand(v, lo)), d, m));
    emit(j + 16, vfma(to_f(ishr(v, four)), d, m));
  }
}

// The fifth bits of a Q5 block's values j..j+kLanes-1 (low half) and j+16.. (high half), at 0x10.
inline void fifth_bits(const uint8_t* qh_bytes, int j, IVec& h0, IVec& h1) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const IVec q = iset(static_cast<int>(qh)), idx = iadd(iota(), iset(j)), bit = iset(0x10);
  h0 = iand(ishl(ishr(q, idx), iset(4)), bit);
  h1 = iand(ishr(q, iadd(idx, iset(12))), bit);
}

template <class E>
inline void q5_0(const uint8_t* b, E& emit) {
  const Vec d = vset(half(b));
  const IVec lo = iset(15), four = iset(4), sixteen = iset(16);
  KVF_UNROLL for (int j = 0; j < 16; j += kLanes) {
    IVec h0, h1;
    fifth_bits(b + 2, j, h0, h1);
    const IVec v = load_u8(b + 6 + j);
    emit(j, vmul(to_f(isub(ior(iand(v, lo), h0), sixteen)), d));
    emit(j + 16, vmul(to_f(isub(ior(ishr(v, four), h1), sixteen)), d));
  }
}

template <class E>
inline void q5_1(const uint8_t* b, E& emit) {
  const Vec d = vset(half(b)), m = vset(half(b + 2));
  const IVec lo = iset(15), four = iset(4);
  KVF_UNROLL for (int j = 0; j < 16; j += kLanes) {
    IVec h0, h1;
    fifth_bits(b + 4, j, h0, h1);
    const IVec v = load_u8(b + 8 + j);
    emit(j, vfma(to_f(ior(iand(v, lo), h0)), d, m));
    emit(j + 16, vfma(to_f(ior(ishr(v, four), h1)), d, m));
  }
}

template <class E>
inline void q8_0(const uint8_t* b, E& emit) {
  const Vec d = vset(half(b));
  KVF_UNROLL for (int j = 0; j < 32; j += kLanes) emit(j, vmul(to_f(load_i8(b + 2 + j)), d));
}

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
inline void scale_min(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <class E>
inline void q4_k(const uint8_t* b, E& emit) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const IVec lo = iset(15), four = iset(4);
  KVF_UNROLL for (int is = 0; is < 8; is += 2) {
    int sc, m;
    scale_min(is, scales, sc, m);
    const Vec d1 = vset(d * sc), m1 = vset(-(dmin * m));
    scale_min(is + 1, scales, sc, m);
    const Vec d2 = vset(d * sc), m2 = vset(-(dmin * m));
    const uint8_t* q = b + 16 + is * 16;
    KVF_UNROLL for (int l = 0; l < 32; l += kLanes) {
      const IVec v = load_u8(q + l);
      emit(is * 32 + l, vfma(to_f(iand(v, lo)), d1, m1));
      emit(is * 32 + 32 + l, vfma(to_f(ishr(v, four)), d2, m2));
    }
  }
}

template <class E>
inline void q5_k(const uint8_t* b, E& emit) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const IVec lo = iset(15), four = iset(4), one = iset(1);
  KVF_UNROLL for (int is = 0; is < 8; is += 2) {
    int sc, m;
    scale_min(is, scales, sc, m);
    const Vec d1 = vset(d * sc), m1 = vset(-(dmin * m));
    scale_min(is + 1, scales, sc, m);
    const Vec d2 = vset(d * sc), m2 = vset(-(dmin * m));
    const uint8_t* ql = b + 48 + is * 16;
    KVF_UNROLL for (int l = 0; l < 32; l += kLanes) {
      const IVec v = load_u8(ql + l), h = load_u8(qh + l);
      const IVec h1 = ishl(iand(ishr(h, iset(is)), one), four);
      const IVec h2 = ishl(iand(ishr(h, iset(is + 1)), one), four);
      emit(is * 32 + l, vfma(to_f(ior(iand(v, lo), h1)), d1, m1));
      emit(is * 32 + 32 + l, vfma(to_f(ior(ishr(v, four), h2)), d2, m2));
    }
  }
}

template <class E>
inline void q6_k(const uint8_t* b, E& emit) {
  const float d = half(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const IVec lo = iset(15), three = iset(3), thirty_two = iset(32);
  const IVec s2 = iset(2), s4 = iset(4), s6 = iset(6);
  KVF_UNROLL for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* s = sc + 8 * h;
    KVF_UNROLL for (int l = 0; l < 32; l += kLanes) {
      const int is = l / 16;
      const IVec a = load_u8(ql + l), c = load_u8(ql + l + 32), hb = load_u8(qh + l);
      const IVec q1 = isub(ior(iand(a, lo), ishl(iand(hb, three), s4)), thirty_two);
      const IVec q2 = isub(ior(iand(c, lo), ishl(iand(ishr(hb, s2), three), s4)), thirty_two);
      const IVec q3 = isub(ior(ishr(a, s4), ishl(iand(ishr(hb, s4), three), s4)), thirty_two);
      const IVec q4 = isub(ior(ishr(c, s4), ishl(iand(ishr(hb, s6), three), s4)), thirty_two);
      const int base = 128 * h + l;
      emit(base, vmul(to_f(q1), vset(d * s[is])));
      emit(base + 32, vmul(to_f(q2), vset(d * s[is + 2])));
      emit(base + 64, vmul(to_f(q3), vset(d * s[is + 4])));
      emit(base + 96, vmul(to_f(q4), vset(d * s[is + 6])));
    }
  }
}

template <class E>
inline void f16(const uint8_t* b, E& emit) {
  KVF_UNROLL for (int j = 0; j < 32; j += kLanes) emit(j, load_f16(b + 2 * j));
}

template <class E>
inline void bf16(const uint8_t* b, E& emit) {
  KVF_UNROLL for (int j = 0; j < 32; j += kLanes) emit(j, load_bf16(b + 2 * j));
}

// visit every block of [b0, b0 + blocks) of one row with `emit`, told each block's first value
template <class E>
inline void visit(int type, const uint8_t* row, int64_t b0, int64_t blocks, E& emit) {
  const BlockShape s = kvf::block_shape(type);
  const uint8_t* b = row + b0 * s.bytes;
  switch (type) {
#define KVF_TYPE(id, fn)                                 \
  case id:                                               \
    for (int64_t i = 0; i < blocks; ++i, b += s.bytes) { \
      emit.start((b0 + i) * s.elems);                    \
      fn(b, emit);                                       \
    }                                                    \
    break;
    KVF_TYPE(kvf::GGML_F16, f16)
    KVF_TYPE(kvf::GGML_BF16, bf16)
    KVF_TYPE(kvf::GGML_Q4_0, q4_0)
    KVF_TYPE(kvf::GGML_Q4_1, q4_1)
    KVF_TYPE(kvf::GGML_Q5_0, q5_0)
    KVF_TYPE(kvf::GGML_Q5_1, q5_1)
    KVF_TYPE(kvf::GGML_Q8_0, q8_0)
    KVF_TYPE(kvf::GGML_Q4_K, q4_k)
    KVF_TYPE(kvf::GGML_Q5_K, q5_k)
    KVF_TYPE(kvf::GGML_Q6_K, q6_k)
#undef KVF_TYPE
    default:
      break;
  }
}

// ------------------------------------------------------------------------------------ emitters

// Dequantization: every vector stored at its place in y (y holds the visited blocks only).
struct Store {
  float* y;
  int64_t first = -1, base = 0;
  void start(int64_t k) {
    if (first < 0) first = k;
    base = k - first;
  }
  void operator()(int off, Vec v) { vstore(y + base + off, v); }
};

// A few rows' products: every vector of weights multiplied by those rows of x and added into
// two accumulators per row, alternating (two chains hide the multiply-add latency).
template <int N>
struct Dot {
  const float* x;
  int64_t in, k = 0;
  Vec acc[N][2];
  void start(int64_t k0) { k = k0; }
  void operator()(int off, Vec v) {
    const int a = (off / kLanes) & 1;
    for (int i = 0; i < N; ++i) acc[i][a] = vfma(v, vload(x + i * in + k + off), acc[i][a]);
  }
};

void dequant(int type, const uint8_t* row, int64_t b0, int64_t blocks, float* y) {
  Store s{y};
  visit(type, row, b0, blocks, s);
}

template <int N>
void few_rows_n(const QuantProduct& p, int64_t r0, int64_t r1) {
  const int64_t blocks = p.in / kvf::block_shape(p.type).elems;
  for (int64_t r = r0; r < r1; ++r) {
    Dot<N> dot{p.x, p.in};
    for (auto& row : dot.acc) row[0] = row[1] = vzero();
    visit(p.type, p.w + r * p.row_bytes, 0, blocks, dot);
    for (int i = 0; i < N; ++i) p.y[i * p.ldy + r] = vsum(vadd(dot.acc[i][0], dot.acc[i][1]));
  }
}

void few_rows(const QuantProduct& p, int64_t r0, int64_t r1) {
  switch (p.n) {
    case 1:
      return few_rows_n<1>(p, r0, r1);
    case 2:
      return few_rows_n<2>(p, r0, r1);
    case 3:
      return few_rows_n<3>(p, r0, r1);
    default:
      return few_rows_n<4>(p, r0, r1);
  }
}

// out[i][j] = sum_k xs[i][k] * ws[j][k] over kc values (a multiple of kLanes)
void tile(const float* const* xs, const float* const* ws, int64_t kc, float* out) {
  Vec acc[kTileRows][kTileCols];
  for (auto& row : acc)
    for (auto& v : row) v = vzero();
  for (int64_t k = 0; k < kc; k += kLanes) {
    Vec xv[kTileRows];
    for (int i = 0; i < kTileRows; ++i) xv[i] = vload(xs[i] + k);
    for (int j = 0; j < kTileCols; ++j) {
      const Vec wv = vload(ws[j] + k);
      for (int i = 0; i < kTileRows; ++i) acc[i][j] = vfma(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < kTileRows; ++i)
    for (int j = 0; j < kTileCols; ++j) out[i * kTileCols + j] = vsum(acc[i][j]);
}

void many_rows(const QuantProduct& p, int64_t r0, int64_t r1, float* scratch) {
  const int64_t blocks = p.in / kvf::block_shape(p.type).elems, rows = r1 - r0;
  for (int64_t j = 0; j < rows; ++j)
    dequant(p.type, p.w + (r0 + j) * p.row_bytes, 0, blocks, scratch + j * p.in);
  const float* xs[kTileRows];
  const float* ws[kTileCols];
  float out[kTileRows * kTileCols];
  for (int64_t i0 = 0; i0 < p.n; i0 += kTileRows) {
    // a tile's rows past the end repeat the last row; their results are not written
    for (int i = 0; i < kTileRows; ++i) xs[i] = p.x + lesser(i0 + i, p.n - 1) * p.in;
    for (int64_t j0 = 0; j0 < rows; j0 += kTileCols) {
      for (int j = 0; j < kTileCols; ++j) ws[j] = scratch + lesser(j0 + j, rows - 1) * p.in;
      tile(xs, ws, p.in, out);
      for (int i = 0; i < kTileRows && i0 + i < p.n; ++i)
        for (int j = 0; j < kTileCols && j0 + j < rows; ++j)
          p.y[(i0 + i) * p.ldy + r0 + j0 + j] = out[i * kTileCols + j];
    }
  }
}

}  // namespace

const kvf::GgmlOps* KVF_OPS_FN() {
  static const kvf::GgmlOps ops{KVF_AVX512 ? "avx512" : "avx2", dequant, few_rows, many_rows};
  return &ops;
}
