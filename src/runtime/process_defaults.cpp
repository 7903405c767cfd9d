// The process defaults of init_process_group(), set_num_threads (include/ddp/threads.h) and
// uncaught errors recorded (include/ddp/error.h).
//
// Note [Process defaults]
// A program written as the README teaches should run as fast as ddp-train and fail as cleanly,
// without knowing what ddp-train does first. So init_process_group() (the default group only,
// not make_process_group: tests host several ranks as threads) sets three things for the whole
// process, each yielding to the user's own choice, and all off with DDP_PROCESS_DEFAULTS=0 or
// InitOptions::process_defaults = false:
// - threads: LibTorch's intra-op pool *and the BLAS* get threads_per_rank(local ranks), so the
//   count no longer depends on the launcher (OMP_NUM_THREADS, when set, is that count);
// - malloc keeps freed memory (retain_freed_memory: no page faults for the activations every
//   step gives back and takes again), unless MALLOC_* or GLIBC_TUNABLES say otherwise;
// - an exception that escapes main() (or a thread) is written once, as "[rank R]: error:
//   uncaught <type>: <what>", recorded in the launcher's error file, and the process exits 1
//   instead of aborting (torchrun's @record); an allocation failure as out_of_memory_text(), which
//   says what holds the memory and what to do. Installed only over the C++ runtime's own handler.
// ensure_fast_blas(), first in main(), adds what needs a fresh image: OPENBLAS_CORETYPE, and
// OMP_WAIT_POLICY=passive with OPENBLAS_THREAD_TIMEOUT=4 where a rank's several threads would
// otherwise find OpenMP's and OpenBLAS's idle threads spinning on each other's cores.
#include "runtime/process_defaults.h"

#include <cxxabi.h>  // __cxa_current_exception_type, __verbose_terminate_handler
#include <unistd.h>  // _exit

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include "base/demangle.h"
#include "base/threads.h"
#include "ddp/allocator.h"
#include "ddp/env.h"
#include "ddp/error.h"
#include "ddp/process_group.h"
#include "ddp/relayed_error.h"
#include "ddp/threads.h"

namespace ddp {
namespace {

std::atomic<int> g_rank_for_errors{-1};
std::terminate_handler g_previous = nullptr;

// Note [Process defaults], the third: one line, the error file, exit 1. Only calls that are safe
// in a dying process after an exception: no locks of ours, no allocation beyond the message.
[[noreturn]] void on_terminate() {
  if (std::exception_ptr current = std::current_exception()) {
    std::string type = "exception", what = "(not a std::exception)";
    if (const std::type_info* info = abi::__cxa_current_exception_type()) {
      type = demangle(info->name());
    }
    try {
      std::rethrow_exception(current);
    } catch (const std::exception& e) {
      if (is_out_of_memory(e)) {  // the words, the cause and the remedy (not the backtrace)
        what = out_of_memory_text(e);
        record_error(what);
      } else {
        what = e.what();
        record_error(e);
      }
    } catch (...) {
      record_error("uncaught " + type);
    }
    const int rank = g_rank_for_errors.load();
    const std::string line =
        (rank >= 0 ? fmt::format("[rank {}]: ", rank) : std::string()) +
        fmt::format("error: uncaught {}: {}\n", type, what);
    std::fflush(stdout);
    (void)!::write(STDERR_FILENO, line.data(), line.size());
    ::_exit(1);
  }
  // std::terminate() with no exception (a noexcept breach without one, an explicit call): the
  // runtime's own behaviour, an abort.
  (g_previous != nullptr ? g_previous : __gnu_cxx::__verbose_terminate_handler)();
  std::abort();
}

}  // namespace

void set_num_threads(int n) {
  n = std::max(1, n);
  at::set_num_threads(n);
  set_blas_threads(n);
}

bool record_uncaught_errors(int rank) {
  if (rank < 0) {
    try {
      const DistEnv env = parse_dist_env(current_environment());
      if (env.contract != LaunchContract::kSingleProcess) rank = env.rank;
    } catch (const Error&) {
      // A malformed launch environment: init_process_group will say so; no prefix here.
    }
  }
  g_rank_for_errors.store(rank);
  const std::terminate_handler current = std::get_terminate();
  if (current == on_terminate) return true;
  if (current != __gnu_cxx::__verbose_terminate_handler && current != nullptr) return false;
  g_previous = current;
  std::set_terminate(on_terminate);
  return true;
}

std::string apply_process_defaults(const ProcessGroup& pg) {
  const int threads = threads_per_rank(pg.local_size());
  set_num_threads(threads);
  const bool kept = retain_freed_memory();
  const bool recorded = record_uncaught_errors(pg.rank());
  const int blas = blas_num_threads();
  return fmt::format("{} intra-op thread{} (BLAS: {}); malloc {}; uncaught errors {}", threads,
                     threads == 1 ? "" : "s", blas < 0 ? "cannot say" : std::to_string(blas),
                     kept ? "keeps freed memory" : "as the environment sets it (MALLOC_*)",
                     recorded ? "recorded (exit 1)" : "left to the program's terminate handler");
}

}  // namespace ddp
