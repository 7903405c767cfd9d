// threads_per_rank and the BLAS's thread calls (include/ddp/threads.h); torch-free, so that
// ensure_fast_blas can decide before LibTorch runs anything.
#include "ddp/threads.h"

#include <dlfcn.h>  // dlsym
#include <sched.h>  // sched_getaffinity

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "base/threads.h"
#include "ddp/env.h"

namespace ddp {
namespace {

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// The BLAS is whatever libblas.so.3 the system selects: its calls are found at run time.
template <typename Fn>
Fn blas_symbol(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

int threads_per_rank(int local_world_size) {
  if (auto omp = env_knob("OMP_NUM_THREADS")) {
    const int n = std::atoi(omp->c_str());
    if (n >= 1) return n;
  }
  return std::max(1, usable_cpus() / std::max(1, local_world_size));
}

void set_blas_threads(int n) {
  using SetFn = void (*)(int);
  if (auto f = blas_symbol<SetFn>("openblas_set_num_threads")) f(std::max(1, n));
  if (auto f = blas_symbol<SetFn>("bli_thread_set_num_threads")) f(std::max(1, n));
}

int blas_num_threads() {
  using GetFn = int (*)();
  if (auto f = blas_symbol<GetFn>("openblas_get_num_threads")) return f();
  if (auto f = blas_symbol<GetFn>("bli_thread_get_num_threads")) return f();
  return -1;
}

}  // namespace ddp
