// The instruction-set-specific half of the GGUF weight kernels (ggml.cpp), as a table of plain
// functions: one table per instruction set, compiled in a file of its own (ggml_avx2.cpp,
// ggml_avx512.cpp) and picked once at run time from what the CPU reports (isa.cpp).
//
// Why a table and files of their own: the module is built once and must run on every x86-64 CPU
// with AVX2 + FMA + F16C, using AVX-512 only where the CPU has it. A file compiled for AVX-512 may
// not define anything another file could link to by accident: an inline function or template
// (std::vector, std::min, a torch header) instantiated there under AVX-512 could be the copy the
// linker keeps for every caller, which would then fault on an AVX2-only CPU. So these files
// include no torch or standard-library templates, keep everything in an anonymous namespace, and
// export one function each that returns their table. This header holds plain C types only.
#pragma once

#include <cstdint>

namespace kvf {

// GGML tensor types (ggml.h's numbering) that the kernels read in place.
enum GgmlType : int {
  GGML_F32 = 0,
  GGML_F16 = 1,
  GGML_Q4_0 = 2,
  GGML_Q4_1 = 3,
  GGML_Q5_0 = 6,
  GGML_Q5_1 = 7,
  GGML_Q8_0 = 8,
  GGML_Q4_K = 12,
  GGML_Q5_K = 13,
  GGML_Q6_K = 14,
  GGML_BF16 = 30,
};

// Elements per block and bytes per block of a type kvfuse reads (F16 and BF16 as blocks of 32
// values, so that every type is walked the same way); {0, 0} for any other type.
struct BlockShape {
  int64_t elems, bytes;
};
static inline BlockShape block_shape(int type) {
  switch (type) {
    case GGML_F16:
    case GGML_BF16:
      return {32, 64};
    case GGML_Q4_0:
      return {32, 18};
    case GGML_Q4_1:
      return {32, 20};
    case GGML_Q5_0:
      return {32, 22};
    case GGML_Q5_1:
      return {32, 24};
    case GGML_Q8_0:
      return {32, 34};
    case GGML_Q4_K:
      return {256, 144};
    case GGML_Q5_K:
      return {256, 176};
    case GGML_Q6_K:
      return {256, 210};
    default:
      return {0, 0};
  }
}

// One product y[:, col0:col0+rows] = x @ W[r0:r0+rows]^T of a weight in GGML blocks (row-major:
// `row_bytes` per output channel), for the rows of x given (n, in), float32 throughout.
struct QuantProduct {
  int type;
  const uint8_t* w;  // the weight's first row
  int64_t row_bytes, in;
  const float* x;  // (n, in), rows contiguous
  int64_t n;
  float* y;  // (n, ldy)
  int64_t ldy;
};

struct GgmlOps {
  const char* isa;  // "avx2" or "avx512"
  // `blocks` blocks of one row from block b0, as float32 values into y.
  void (*dequant)(int type, const uint8_t* row, int64_t b0, int64_t blocks, float* y);
  // Output channels [r0, r1) of p for a few rows of x (n <= kFewRows): each weight value
  // dequantized in registers and multiplied by every row of x, nothing stored between.
  void (*few_rows)(const QuantProduct& p, int64_t r0, int64_t r1);
  // Output channels [r0, r1) (at most kGroupRows) of p for any number of rows: those channels
  // dequantized into `scratch` (kGroupRows x in floats, row-major: it stays in L2) and
  // multiplied by the rows of x, a register tile of rows x channels at a time.
  void (*many_rows)(const QuantProduct& p, int64_t r0, int64_t r1, float* scratch);
};

constexpr int64_t kFewRows = 4;     // up to this many rows of x, few_rows
constexpr int64_t kGroupRows = 16;  // output channels per call of many_rows

const GgmlOps* ggml_ops_avx2();
const GgmlOps* ggml_ops_avx512();

}  // namespace kvf
