// Test support: N ranks as N threads of one process, over Gloo on 127.0.0.1 (gloo's pattern),
// or over the shared-memory transport when DDP_TEST_BACKEND=shm (ctest runs the collective
// suites both ways: tests/collective/CMakeLists.txt).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "base/net.h"
#include "ddp/process_group.h"
#include "process_group/testing.h"  // TestingOptions: thread-ranks laid out as hosts

namespace ddp::testing {

// A port that was free a moment ago (the kernel picks it; collisions are unlikely).
inline int free_port() { return net::pick_free_port(); }

// The backend thread-rank tests run over: DDP_TEST_BACKEND, else "gloo".
inline std::string test_backend() {
  const char* v = std::getenv("DDP_TEST_BACKEND");
  return v != nullptr && *v != '\0' ? v : "gloo";
}

// DDP_TEST_HOSTS=K lays thread-ranks out as K hosts of consecutive ranks (TestingOptions::host_id):
// with backend "shm+gloo" (or "auto") and equal hosts, the suites run over the hierarchical
// transport.
inline int test_hosts() {
  const char* v = std::getenv("DDP_TEST_HOSTS");
  return v == nullptr || *v == '\0' ? 0 : std::max(1, std::atoi(v));
}
inline std::optional<std::string> test_host_of(int rank, int world) {
  const int hosts = test_hosts();
  if (hosts == 0) return std::nullopt;
  return "test-host-" + std::to_string(rank * hosts / world);
}

// The backend of a group of `world` thread-ranks: DDP_TEST_BACKEND=shm+gloo asks for the
// hierarchy by name where the layout has one (equal hosts, several ranks on each), and "auto"
// elsewhere (Gloo, or shm on one host), where shm+gloo would be refused.
inline std::string test_backend_for(int world) {
  const std::string b = test_backend();
  const int hosts = std::max(1, test_hosts());
  const bool hierarchy = hosts > 1 && world % hosts == 0 && world / hosts > 1;
  return b == "shm+gloo" && !hierarchy ? "auto" : b;
}

// Options that place `rank` of `world` on a store at 127.0.0.1:`port` (and, with
// DDP_TEST_HOSTS, on its host: detail::TestingOptions).
inline detail::TestingOptions thread_rank(
    int rank, int world, int port, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  detail::TestingOptions o;
  o.backend = test_backend_for(world);
  o.host_id = test_host_of(rank, world);
  o.rank = rank;
  o.world_size = world;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.rendezvous_timeout = std::chrono::seconds(30);
  o.timeout = timeout;
  return o;
}

// A group of one rank (world size 1): no sockets, for tests that need a group but no peers.
inline InitOptions one_rank_options() {
  InitOptions o;
  o.rank = 0;
  o.world_size = 1;
  return o;
}
inline std::shared_ptr<ProcessGroup> one_rank_group() {
  return make_process_group(one_rank_options());
}

// Runs fn(rank) on `world` threads and returns each thread's exception (nullptr if none).
inline std::vector<std::exception_ptr> run_threads(int world, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  }
  return "";
}

// Forms a group of `world` thread-ranks and runs fn(pg) on each; any exception fails the test.
inline void run_ranks(int world, const std::function<void(ProcessGroup&)>& fn,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  const int port = free_port();
  auto errors = run_threads(world, [&](int r) {
    auto pg = make_process_group(thread_rank(r, world, port, timeout));
    fn(*pg);
    pg->barrier().wait();  // keep the store (rank 0) alive until everyone is done
  });
  for (int r = 0; r < world; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << message_of(errors[r]);
  }
}

}  // namespace ddp::testing
