// A test worker written as the README teaches (ensure_fast_blas, init_process_group, no
// try/catch around main's body), for test_process_defaults:
//   process_defaults_worker threads      prints "threads T blas B wait W timeout O reexec R
//                                        core C" (OMP_WAIT_POLICY, OPENBLAS_THREAD_TIMEOUT,
//                                        whether ensure_fast_blas re-executed it, OpenBLAS's core)
//   process_defaults_worker uncaught     rank 1 leaves once the group is formed; rank 0's
//                                        all_reduce fails and the error escapes main()
//   process_defaults_worker own-handler  the same, with a terminate handler of the program's own
//                                        (set before init): it prints and exits 7
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "ddp/ddp.h"
#include "ddp/runtime.h"

int main(int argc, char** argv) {
  const ddp::BlasReport blas = ddp::ensure_fast_blas(argc, argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "own-handler") {
    std::set_terminate([] {
      std::fprintf(stderr, "the program's own terminate handler\n");
      std::_Exit(7);
    });
  }
  ddp::init_process_group();
  if (mode == "threads") {
    const char* wait = std::getenv("OMP_WAIT_POLICY");
    const char* timeout = std::getenv("OPENBLAS_THREAD_TIMEOUT");
    std::printf("threads %d blas %d wait %s timeout %s reexec %d core %s\n", at::get_num_threads(),
                ddp::blas_num_threads(), wait != nullptr ? wait : "unset",
                timeout != nullptr ? timeout : "unset", blas.reexecuted ? 1 : 0,
                blas.core.empty() ? "none" : blas.core.c_str());
    ddp::destroy_process_group();
    return 0;
  }
  if (ddp::get_rank() == 1) std::_Exit(0);  // leaves without a word
  torch::Tensor t = torch::ones({4});
  ddp::all_reduce(t);  // fails: rank 1 is gone; nothing catches the error
  std::printf("unreachable\n");
  return 0;
}
