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

namespace ddp {

struct BlasReport {
  std::string library;        // resolved path of the loaded libblas; empty when none is loaded
  std::string vendor;         // "OpenBLAS", "reference BLAS (netlib)", "unknown" or "none"
  std::string core;           // OpenBLAS's kernel core in use (e.g. "Haswell"), else empty
  std::string cpu_best_core;  // best OpenBLAS core this CPU can run, empty if none better
                              // than the generic ones
  std::string user_coretype;  // OPENBLAS_CORETYPE from the environment, empty if unset
  bool reexecuted = false;    // ensure_fast_blas() re-executed us to set OPENBLAS_CORETYPE

  // OpenBLAS runs a weaker core than this CPU supports and the user did not choose one.
  bool needs_core_override() const;
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

// If OpenBLAS runs a weaker core than this CPU supports and OPENBLAS_CORETYPE is unset,
// re-executes this program (same pid, same argv) once with OPENBLAS_CORETYPE set to
// best_openblas_core(). A user's own OPENBLAS_CORETYPE always wins. Returns the report of the
// BLAS in use (after the re-exec, `reexecuted` is true). Call it first thing in main().
BlasReport ensure_fast_blas(int argc, char** argv);

}  // namespace ddp
