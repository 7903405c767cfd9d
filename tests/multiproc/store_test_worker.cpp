// store_test_worker: a job whose rendezvous store a test attacks while the job runs.
//
//   ddprun --standalone --nproc-per-node 2 store_test_worker GO_FILE
//   [rank 0]: store-ready pid=4711 port=41397
//   ... (the test attacks 127.0.0.1:41397, then creates GO_FILE)
//   [rank 0]: result 6
//   [rank 1]: result 6
//
// 1. Forms the default group: rank 0 hosts the store.
// 2. Rank 0 prints its pid and the store's port; every rank waits for GO_FILE (60 s at most,
//    then exits 99) while the test attacks the store.
// 3. Forms a second group through the same store (DDP_AGENT_STORE=ddp, as ddp-bench does):
//    the store must still serve a whole rendezvous, backend agreement and transport setup.
//    All-reduces (rank + 1) over the first group, then the result over the second, and prints
//    it: 2 x (1 + ... + N), e.g. 6 for 2 ranks.
#include <sys/stat.h>  // stat
#include <unistd.h>    // getpid

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/process_group.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: store_test_worker GO_FILE\n");
    return 98;
  }
  try {
    auto first = ddp::make_process_group();
    if (first->rank() == 0) {
      fmt::print("store-ready pid={} port={}\n", static_cast<int>(::getpid()),
                 std::getenv("MASTER_PORT"));
      std::fflush(stdout);
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    struct stat st {};
    while (::stat(argv[1], &st) != 0) {
      if (std::chrono::steady_clock::now() > until) return 99;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
    ::setenv("DDP_AGENT_STORE", "ddp", 1);
    ddp::InitOptions o;
    o.group_name = "second";
    auto second = ddp::make_process_group(o);
    at::Tensor t = at::full({4}, first->rank() + 1, at::kFloat);
    first->all_reduce(t).wait();
    second->all_reduce(t).wait();
    fmt::print("result {}\n", t[0].item<float>());
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    ddp::record_error(e.what());
    std::fprintf(stderr, "store_test_worker: %s\n", e.what());
    return 1;
  }
}
