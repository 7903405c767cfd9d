// hang_test_worker: a job for the hang-report tests, driven by its argument.
//
//   ddprun --standalone --nproc-per-node 2 hang_test_worker loop
//   [rank 1]: ready pid=4711
//   ... all-reduces until a failure (the test SIGSTOPs rank 1)
//
//   ddprun --standalone --nproc-per-node 2 hang_test_worker skip
//     all-reduces #1-#4 at steps 1-4; rank 1 skips #5 and sleeps 60 s; rank 0 times out.
//
//   hang_test_worker recv    (two ranks started by hand: no launcher to end rank 0)
//     rank 1 prints "ready pid=N" and sleeps 60 s without sending; rank 0 waits in a recv
//     from it (the test SIGKILLs rank 1).
//
// Errors are printed with the rank and recorded for ddprun (exit 1).
#include <unistd.h>  // getpid

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "ddp/distributed.h"
#include "ddp/error.h"

int main(int argc, char** argv) {
  const std::string mode = argc == 2 ? argv[1] : "";
  if (mode != "loop" && mode != "skip" && mode != "recv") {
    std::fprintf(stderr, "usage: hang_test_worker loop|skip|recv\n");
    return 98;
  }
  try {
    ddp::init_process_group();
    const int rank = ddp::get_rank();
    if (mode == "recv") {
      if (rank == 1) {
        fmt::print("ready pid={}\n", static_cast<int>(::getpid()));
        std::fflush(stdout);
        std::this_thread::sleep_for(std::chrono::seconds(60));
        return 0;
      }
      at::Tensor t = at::zeros({4});
      ddp::recv(t, 1);
      return 0;
    }
    for (int64_t step = 1; step < 100000; ++step) {
      ddp::set_training_step(step);
      if (mode == "skip" && step == 5 && rank == 1) {
        std::this_thread::sleep_for(std::chrono::seconds(60));
        return 0;
      }
      at::Tensor t = at::ones({4});
      ddp::all_reduce(t);
      if (mode == "loop" && step == 3 && rank == 1) {
        fmt::print("ready pid={}\n", static_cast<int>(::getpid()));
        std::fflush(stdout);
      }
      if (mode == "loop") std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] hang_test_worker: %s\n", ddp::get_rank(), e.what());
    ddp::record_error(e.what());
    return 1;
  }
}
