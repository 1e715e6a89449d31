// The GGUF weight kernels compiled for AVX-512 (F, BW, VL, DQ), used only on CPUs that report it
// (isa.cpp); ggml_impl.h holds the code, ggml_ops.h says why each instruction set has a file.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define KVF_AVX512 1
#define KVF_OPS_FN kvf::ggml_ops_avx512
#include "ggml_impl.h"
