// The GGUF weight kernels compiled for AVX2 + FMA + F16C, the floor every kernel of the module
// needs (ggml_impl.h holds the code, ggml_ops.h says why each instruction set has a file).
#pragma GCC target("avx2,fma,f16c")
#define KVF_AVX512 0
#define KVF_OPS_FN kvf::ggml_ops_avx2
#include "ggml_impl.h"
