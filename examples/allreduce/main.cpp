// allreduce: the smallest complete ddp-cpp program. Every rank contributes (rank + 1) and
// all-reduces; every rank must then hold 1 + 2 + ... + N.
//
//   $ ddprun --standalone --nproc-per-node 2 build/examples/allreduce
//   [rank 0]: rank 0/2 (local 0/2, node 0) via torchrun/ddprun; store 127.0.0.1:41397
//   [rank 0]: BLAS: OpenBLAS (core Cooperlake) from /usr/lib/x86_64-linux-gnu/openblas-...
//   [rank 0]: all_reduce(sum) of [1, 2] over 2 ranks = 3 (expected 3): OK
//   [rank 1]: all_reduce(sum) of [1, 2] over 2 ranks = 3 (expected 3): OK
//
// Also runs under `torchrun --no-python`, `mpirun -np N`, `srun`, or alone (1 rank).
// Arguments (for tests): --elements N (tensor size, default 4), --hang-rank R (that rank stops
// calling collectives, to show the timeout), --throw-rank R (that rank throws after joining).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "ddp/ddp.h"
#include "ddp/runtime.h"  // ensure_fast_blas, inspect_blas

namespace {

struct Args {
  int64_t elements = 4;
  int hang_rank = -1;
  int throw_rank = -1;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--elements") == 0)
      a.elements = std::atoll(argv[i + 1]);
    else if (std::strcmp(argv[i], "--hang-rank") == 0)
      a.hang_rank = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--throw-rank") == 0)
      a.throw_rank = std::atoi(argv[i + 1]);
    else
      throw ddp::ConfigError(std::string("unknown argument ") + argv[i]);
  }
  return a;
}

int run(const Args& args) {
  auto pg = ddp::init_process_group();
  const int rank = pg->rank();
  const int n = pg->size();
  if (rank == 0) {
    std::printf("%s\n%s\n", pg->env().describe().c_str(), ddp::inspect_blas().summary().c_str());
    std::fflush(stdout);
  }
  if (rank == args.throw_rank) {
    throw ddp::Error("[rank " + std::to_string(rank) + "] --throw-rank asked this rank to fail");
  }
  if (rank == args.hang_rank) {
    std::this_thread::sleep_for(std::chrono::hours(1));  // the others time out
  }

  torch::Tensor t = torch::full({args.elements}, static_cast<float>(rank + 1));
  pg->all_reduce(t, ddp::ReduceOp::kSum).wait();
  const float expected = n * (n + 1) / 2.0f;
  const bool ok = torch::all(t == expected).item<bool>();
  std::printf("all_reduce(sum) of [1..%d] over %d ranks = %g (expected %g): %s\n", n, n,
              t[0].item<float>(), expected, ok ? "OK" : "WRONG");
  ddp::barrier();  // nobody tears down the store while others still talk
  ddp::destroy_process_group();
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::ensure_fast_blas(argc, argv);
  try {
    return run(parse(argc, argv));
  } catch (const ddp::ConfigError& e) {
    std::fprintf(stderr, "allreduce: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce: %s\n", e.what());
    ddp::record_error(e);
    return 1;
  }
}
