// DDP's contract across real processes: N processes with b rows each end, after 20 SGD steps,
// with the parameters (and buffers) one process gets on the N*b rows, for every model of the
// thread-level equivalence tests (max abs diff <= 1e-5), at N = 2, 3, 4.
#include <unistd.h>  // geteuid

#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/ranks.h"  // free_port
#include "support/saved_state.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Result;
using testing::run_command;

class Processes : public ::testing::TestWithParam<std::string> {};

TEST_P(Processes, EqualOneProcessOnTheWholeBatch) {
  const std::string kind = GetParam();
  const std::string worker = testing::env_or_die("EQUIVALENCE_WORKER");
  const std::string ddprun = testing::env_or_die("DDPRUN");
  const fs::path dir = ddp::testing::make_temp_dir("ddp_processes");
  for (int n : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("{} at {} processes", kind, n));
    const std::string chunks = std::to_string(n);
    const fs::path one = dir / "one.pt", many = dir / "many.pt";
    Result ref =
        run_command({.argv = {worker, kind, one.string(), "--chunks", chunks}, .timeout_s = 60});
    ASSERT_TRUE(ref.exited(0)) << ref.describe();
    Result ddp = run_command({.argv = {ddprun, "--standalone", "--nproc-per-node", chunks, worker,
                                       kind, many.string(), "--chunks", chunks},
                              .timeout_s = 120});
    ASSERT_TRUE(ddp.exited(0)) << ddp.describe();
    testing::expect_same_state(one, many, 1e-5);
  }
  fs::remove_all(dir);
}

// Two "hosts" (each ddprun in its own UTS namespace, so the hostnames differ) of two processes:
// the group runs shm inside each host and Gloo between them (shm+gloo), and still equals one
// process on the whole batch.
TEST(TwoHosts, HierarchicalTransportEqualsOneProcess) {
  const std::string worker = testing::env_or_die("EQUIVALENCE_WORKER");
  const std::string ddprun = testing::env_or_die("DDPRUN");
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for unshare --uts";
  const fs::path dir = ddp::testing::make_temp_dir("ddp_two_hosts");
  const fs::path one = dir / "one.pt", many = dir / "many.pt";
  Result ref =
      run_command({.argv = {worker, "mlp", one.string(), "--chunks", "4"}, .timeout_s = 60});
  ASSERT_TRUE(ref.exited(0)) << ref.describe();
  const std::string port = std::to_string(testing::free_port());
  auto node = [&](int k) {
    const std::string launch = fmt::format(
        "hostname ddp-test-host{} && exec {} --nnodes 2 --node-rank {} --nproc-per-node 2 "
        "--master-addr 127.0.0.1 --master-port {} {} mlp {} --chunks 4",
        k, ddprun, k, port, worker, many.string());
    return testing::Subprocess::start(
        {.argv = {"/usr/bin/unshare", "--uts", "/bin/sh", "-c", launch},
         .env = {{"DDP_DEBUG", "info"}},
         .timeout_s = 120});
  };
  auto host0 = node(0);
  auto host1 = node(1);
  Result r0 = host0.wait(), r1 = host1.wait();
  ASSERT_TRUE(r0.exited(0)) << r0.describe();
  ASSERT_TRUE(r1.exited(0)) << r1.describe();
  EXPECT_NE((r0.out + r0.err).find("of 4 ranks over shm+gloo"), std::string::npos) << r0.describe();
  testing::expect_same_state(one, many, 1e-5);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Models, Processes, ::testing::Values("mlp", "cnn", "branchy", "many"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ddp
