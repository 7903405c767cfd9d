// Which BLAS is doing LibTorch's matrix work, and making sure it is a fast one.
//
// Debian's LibTorch calls whatever libblas.so.3 the system's alternatives select. The netlib
// reference BLAS is 20-50x slower than OpenBLAS on every Linear layer, and Debian's OpenBLAS
// 0.3.21 falls back to SSE3 kernels on CPUs it does not recognise (some AVX-512 Xeons) unless
// OPENBLAS_CORETYPE names a core it knows. OpenBLAS reads that variable once, when it is
// loaded, so the fix is applied by re-executing the program with the variable set.
//
// Thread-safety: inspect_blas() is safe from any thread; ensure_fast_blas() must be the first
// thing main() does (it may replace the process image).
#pragma once

#include <string>
#include <string_view>

#include "ddp/env.h"  // EnvMap

namespace ddp {

struct BlasReport {
  std::string library;        // resolved path of the loaded libblas; empty when none is loaded
  std::string vendor;         // "OpenBLAS", "reference BLAS (netlib)", "unknown" or "none"
  std::string core;           // OpenBLAS's kernel core in use (e.g. "Haswell"), else empty
  std::string cpu_best_core;  // best OpenBLAS core this CPU can run, empty if none better
                              // than the generic ones
  std::string user_coretype;  // OPENBLAS_CORETYPE from the environment, empty if unset
  std::string threading;      // OpenBLAS's: "pthreads", "OpenMP" or "sequential"; else empty
  bool reexecuted = false;    // ensure_fast_blas() re-executed us
  bool chose_core = false;    // ddp set OPENBLAS_CORETYPE (the re-exec, or a launcher)
  bool chose_wait = false;    // ddp set OMP_WAIT_POLICY and OPENBLAS_THREAD_TIMEOUT
  std::string wait_policy;    // OMP_WAIT_POLICY from the environment, empty if unset
  std::string thread_timeout; // OPENBLAS_THREAD_TIMEOUT from the environment, empty if unset
  int rank_threads = 1;       // threads_per_rank() from the launch environment

  // OpenBLAS runs a weaker core than this CPU supports and the user did not choose one.
  bool needs_core_override() const;
  // OpenBLAS runs its own pthreads beside LibTorch's OpenMP pool and this rank runs more than
  // one thread: each pool's idle threads spin on the cores the other's need (OpenMP's about
  // 300 000 iterations after a parallel region, OpenBLAS's 2^28 cycles after a call), unless
  // OMP_WAIT_POLICY (or GOMP_SPINCOUNT) and OPENBLAS_THREAD_TIMEOUT say otherwise. True when
  // one of the two is unset. Measured, 1 process x 2 threads on 2 cores (docs/performance.md#blas):
  // passive OpenMP and OPENBLAS_THREAD_TIMEOUT=4 took the MLP from 3726 to 12770 samples/s,
  // the classic CNN from 1149 to 1460, ddp-train's CNN from 988 to 1193.
  bool needs_quiet_threads() const;
  bool is_reference() const { return vendor == "reference BLAS (netlib)"; }
  // One line for logs, ending with advice when something is slow.
  std::string summary() const;
};

// Inspects the BLAS loaded in this process (loads libblas.so.3 if nothing has yet).
BlasReport inspect_blas();

// Instruction-set level an OpenBLAS core name needs: 4 AVX-512, 3 AVX2, 2 AVX, 1 SSE-only,
// 0 unknown name. Case-insensitive.
int openblas_core_level(std::string_view core);

// Best OpenBLAS core this CPU (and OS) can run, from its actual CPUID features; never a core
// the CPU cannot execute. Empty when no better choice than the generic cores exists.
std::string best_openblas_core();

// inspect_blas() as a program that loads libblas.so.3 finds it, run in a child process (fork)
// so that this one loads nothing (OpenBLAS starts its threads as it loads). For a launcher:
// call it before starting threads. vendor "unknown" when the child fails (within 10 s).
BlasReport inspect_blas_apart();

// What ensure_fast_blas() would set in a process that starts with `env` (its launch
// variables: LOCAL_WORLD_SIZE, OMP_NUM_THREADS) and loads the BLAS `blas` describes
// (inspect_blas_apart()), with the variable that tells its report ddp chose them; each only
// where `env` lacks it, nothing when nothing would change. A launcher adds these to a worker's
// environment (ddprun does), so that the worker starts with them and need not re-execute:
// LibTorch starts once per worker instead of twice, about 1 CPU-second less each.
EnvMap fast_blas_environment(const BlasReport& blas, const EnvMap& env);

// Settings read only when a library loads, so only a fresh image can change them: re-executes
// this program (same pid, same argv) once with
//   - OPENBLAS_CORETYPE=best_openblas_core() if OpenBLAS runs a weaker core than this CPU
//     supports and the variable is unset;
//   - OMP_WAIT_POLICY=passive and OPENBLAS_THREAD_TIMEOUT=4 (each where unset) if
//     needs_quiet_threads().
// A user's own value always wins; nothing to change (a launcher set them: fast_blas_environment),
// no re-exec. Returns the report of the BLAS in use (after the re-exec, `reexecuted` is true).
// Call it first thing in main().
// `threads`: the most intra-op threads this process will run, when the program knows better
// than threads_per_rank() of the launch environment (0: that).
BlasReport ensure_fast_blas(int argc, char** argv, int threads = 0);

}  // namespace ddp
