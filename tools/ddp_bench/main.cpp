// ddp-bench: collectives and training throughput, measured the nccl-tests way (every result
// verified; algbw and busbw; medians; tables, CSV, PNG).
//
//   $ ddprun --standalone --nproc-per-node 2 ddp-bench collectives --backend gloo,shm --max-bytes 16M
//   [rank 0]: # ddp-bench collectives: 2 ranks on host; sizes 8 B to 16 MiB; 20 iterations ...
//   [rank 0]: # memcpy floor: one core copies 16 MiB (out of cache) in ... us: ... GB/s
//   [rank 0]: # gloo: all_reduce (sum), float32
//   [rank 0]: #        size       count    time(us)  algbw(GB/s)  busbw(GB/s)  #wrong
//   [rank 0]:          8 B           2       ...
//   $ ddprun --standalone --nproc-per-node 2 ddp-bench train --model classic-cnn --compare
//
// Modes: collectives.h and train.h. Only this function turns errors into exit codes: 0 done
// (and, for collectives, every result verified), 1 failed or a wrong result, 2 bad command line.
#include <algorithm>
#include <cstdio>
#include <string_view>
#include <thread>
#include <exception>

#include "cli.h"
#include "collectives.h"
#include "ddp/ddp.h"
#include "ddp/runtime.h"  // ensure_fast_blas, retain_freed_memory
#include "train.h"

namespace {

int rank_for_messages() {
  try {
    return ddp::parse_dist_env(ddp::current_environment()).rank;
  } catch (...) {
    return 0;
  }
}

int fail(const std::exception& e, int code) {
  std::fprintf(stderr, "[rank %d] ddp-bench: %s\n", rank_for_messages(), e.what());
  ddp::record_error(e);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // --compare also measures 1 process x N threads (N ranks' worth of cores): its OpenMP pool
  // must not spin while OpenBLAS works, whatever the launcher set for the ranks.
  const bool compares = std::find(argv, argv + argc, std::string_view("--compare")) != argv + argc;
  ddp::ensure_fast_blas(argc, argv, compares ? static_cast<int>(std::thread::hardware_concurrency()) : 0);
  ddp::retain_freed_memory();  // activations come back every step: no page faults for them
  try {
    const ddp::bench::CommandLine cl =
        ddp::bench::parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
    switch (cl.mode) {
      case ddp::bench::CommandLine::Mode::kCollectives:
        return ddp::bench::run_collectives(cl.collectives);
      case ddp::bench::CommandLine::Mode::kTrain: return ddp::bench::run_train(cl.train);
      case ddp::bench::CommandLine::Mode::kHelp: std::printf("%s", cl.help_text.c_str()); return 0;
    }
  } catch (const ddp::ConfigError& e) {
    return fail(e, 2);
  } catch (const std::exception& e) {
    return fail(e, 1);
  }
  return 1;
}
