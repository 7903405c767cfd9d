// DDP's contract across real processes: N processes with b rows each end, after 20 SGD steps,
// with the parameters (and buffers) one process gets on the N*b rows, for every model of the
// thread-level equivalence tests (max abs diff <= 1e-5), at N = 2, 3, 4.
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/saved_state.h"
#include "support/subprocess.h"

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
  char tmpl[] = "/tmp/ddp_processes_XXXXXX";
  const fs::path dir = mkdtemp(tmpl);
  for (int n : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("{} at {} processes", kind, n));
    const std::string chunks = std::to_string(n);
    const fs::path one = dir / "one.pt", many = dir / "many.pt";
    Result ref = run_command({.argv = {worker, kind, one.string(), "--chunks", chunks},
                              .timeout_s = 60});
    ASSERT_TRUE(ref.exited(0)) << ref.describe();
    Result ddp = run_command({.argv = {ddprun, "--standalone", "--nproc-per-node", chunks,
                                       worker, kind, many.string(), "--chunks", chunks},
                              .timeout_s = 120});
    ASSERT_TRUE(ddp.exited(0)) << ddp.describe();
    auto a = testing::load_state(one), b = testing::load_state(many);
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, tensor] : a) {
      ASSERT_EQ(b.count(name), 1u) << name;
      EXPECT_LE((tensor.to(torch::kDouble) - b[name].to(torch::kDouble)).abs().max().item<double>(),
                1e-5)
          << name;
    }
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Models, Processes,
                         ::testing::Values("mlp", "cnn", "branchy", "many"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ddp
