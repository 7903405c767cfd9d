// early_exit_worker: a job in which one rank leaves early, with exit code 0, while the others
// still all-reduce (a rank whose loop ended, say on fewer batches).
//
//   DDP_BACKEND=shm ddprun --standalone --nproc-per-node 3 early_exit_worker STEPS EXIT_RANK
//   [rank 0]: step 0 sum 6
//   ...
//   [rank 1]: leaving after step 2 with exit code 0
//   [rank 0]: [rank 0] all_reduce #4 ... failed: rank 1 ...
//
// Every rank all-reduces (rank + 1) STEPS times, 20 ms apart; EXIT_RANK returns from main
// (exit code 0) after STEPS / 2 of them. The others must fail, naming it, well within the
// collective timeout (DDP_COLLECTIVE_TIMEOUT), never hang.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/process_group.h"
#include "ddp/relayed_error.h"  // record_error(exception)

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: early_exit_worker STEPS EXIT_RANK\n");
    return 98;
  }
  const int steps = std::atoi(argv[1]);
  const int exit_rank = std::atoi(argv[2]);
  try {
    auto group = ddp::make_process_group();
    for (int step = 0; step < steps; ++step) {
      at::Tensor t = at::full({1024}, group->rank() + 1, at::kFloat);
      group->all_reduce(t).wait();
      if (group->rank() == 0) fmt::print("step {} sum {}\n", step, t[0].item<float>());
      std::fflush(stdout);
      if (group->rank() == exit_rank && step == steps / 2) {
        fmt::print("leaving after step {} with exit code 0\n", step);
        std::fflush(stdout);
        return 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    fmt::print("done\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    ddp::record_error(e);
    return 1;
  }
}
