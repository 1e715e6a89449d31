// Which instruction sets this CPU has, and which of the GGUF kernels' tables (ggml_ops.h) run on
// it: AVX-512 where the CPU reports F, BW, VL and DQ, else AVX2 (the module's floor). Asked once,
// from the CPU itself (cpuid through GCC's __builtin_cpu_supports, which also checks that the OS
// saves the vector registers); `set_isa` narrows the choice (tests, and measurements of the
// AVX2 path on an AVX-512 CPU).

#include <atomic>

#include "ggml_ops.h"
#include "kernels.h"

namespace {

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

const kvf::GgmlOps* best() { return has_avx512() ? kvf::ggml_ops_avx512() : kvf::ggml_ops_avx2(); }

std::atomic<const kvf::GgmlOps*> chosen{nullptr};

}  // namespace

const kvf::GgmlOps* ggml_ops() {
  const kvf::GgmlOps* ops = chosen.load(std::memory_order_acquire);
  if (ops == nullptr) {
    ops = best();
    chosen.store(ops, std::memory_order_release);
  }
  return ops;
}

std::map<std::string, bool> cpu_features() {
  __builtin_cpu_init();
  return {
      {"avx2", static_cast<bool>(__builtin_cpu_supports("avx2"))},
      {"fma", static_cast<bool>(__builtin_cpu_supports("fma"))},
      {"f16c", static_cast<bool>(__builtin_cpu_supports("f16c"))},
      {"avx_vnni", static_cast<bool>(__builtin_cpu_supports("avxvnni"))},
      {"avx512f", static_cast<bool>(__builtin_cpu_supports("avx512f"))},
      {"avx512bw", static_cast<bool>(__builtin_cpu_supports("avx512bw"))},
      {"avx512vl", static_cast<bool>(__builtin_cpu_supports("avx512vl"))},
      {"avx512dq", static_cast<bool>(__builtin_cpu_supports("avx512dq"))},
      {"avx512_vnni", static_cast<bool>(__builtin_cpu_supports("avx512vnni"))},
      {"avx512_bf16", static_cast<bool>(__builtin_cpu_supports("avx512bf16"))},
      {"amx_tile", static_cast<bool>(__builtin_cpu_supports("amx-tile"))},
      {"amx_bf16", static_cast<bool>(__builtin_cpu_supports("amx-bf16"))},
      {"amx_int8", static_cast<bool>(__builtin_cpu_supports("amx-int8"))},
  };
}

std::string isa() { return ggml_ops()->isa; }

void set_isa(std::string name) {
  if (name == "auto") {
    chosen.store(best(), std::memory_order_release);
  } else if (name == "avx2") {
    chosen.store(kvf::ggml_ops_avx2(), std::memory_order_release);
  } else if (name == "avx512") {
    TORCH_CHECK(has_avx512(), "this CPU has no AVX-512 (F, BW, VL, DQ): use avx2 or auto");
    chosen.store(kvf::ggml_ops_avx512(), std::memory_order_release);
  } else {
    TORCH_CHECK(false, "unknown instruction set ", name, ": use auto, avx2 or avx512");
  }
}
