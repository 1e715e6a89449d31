// kvf::parallel_for: at::parallel_for's split of [begin, end) into one chunk per thread (at most
// one per `grain` items, inline when one thread would do), over the calling thread's OpenMP count.
//
// Not at::parallel_for itself: its first call on a thread from this library (a thread_local flag
// of this library's own copy of PyTorch's inline code) resets the thread's count to PyTorch's
// process-wide one, the last count any thread set. kvfuse.threads gives the engine's thread its
// count and the helpers one thread each; through at::parallel_for the engine's first step would
// take a helper's one (measured: 18 ms steps instead of 11 on SmolLM2, 2 cores).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

namespace kvf {

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (grain > 0) threads = std::min<int64_t>(threads, (n + grain - 1) / grain);
  if (threads <= 1) {
    f(begin, end);
    return;
  }
  std::exception_ptr error;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t parts = omp_get_num_threads(), chunk = (n + parts - 1) / parts;
    const int64_t b = begin + omp_get_thread_num() * chunk, e = std::min(end, b + chunk);
    if (b < e) {
      try {
        f(b, e);
      } catch (...) {
        if (!failed.test_and_set()) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kvf
