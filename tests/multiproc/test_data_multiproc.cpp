// Real processes under ddprun: the sampler takes its world size and rank from the default
// process group, the shards are the ones each rank computes alone, and the exact evaluation
// (pad=false + all_reduce over the default group) equals one process at 1, 2 and 3 ranks.
//
// The workers are this test binary itself, running its DISABLED_Worker test (gtest skips
// disabled tests unless asked, so a plain run never executes it).
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/data_loader.h"
#include "ddp/distributed.h"
#include "ddp/metrics.h"
#include "support/subprocess.h"

namespace ddp {
namespace {

constexpr int64_t kN = 101;
constexpr uint64_t kSeed = 3;
constexpr int64_t kEpoch = 4;

std::shared_ptr<TensorDataset> logits_dataset() {
  torch::manual_seed(99);
  return std::make_shared<TensorDataset>(torch::randn({kN, 10}) * 3,
                                         torch::randint(10, {kN}, torch::kLong));
}

EvalStats evaluate(DataLoader& loader) {
  EvalStats s;
  for (auto& b : loader) {
    auto logp = torch::log_softmax(b.data, 1);
    s.add(logp, b.target, torch::nll_loss(logp, b.target, {}, at::Reduction::None));
  }
  return s;
}

// One rank, started by ddprun: prints its shard and the reduced evaluation.
TEST(MultiProcessData, DISABLED_Worker) {
  init_process_group();
  DistributedSampler train(kN, {.seed = kSeed});  // world size and rank: the default group
  train.set_epoch(kEpoch);
  std::cout << fmt::format("SHARD {} {} {}\n", train.rank(), train.num_replicas(),
                           fmt::join(train.indices(), " "));
  auto data = logits_dataset();
  DataLoader loader(data, DistributedSampler(kN, {.shuffle = false, .pad = false}),
                    {.batch_size = 8, .num_workers = 1});
  const EvalStats all = all_reduce(evaluate(loader));
  std::cout << fmt::format("EVAL {} {} {} {:a}\n", get_rank(), all.count, all.correct,
                           all.loss_sum);
  std::cout.flush();
  destroy_process_group();
}

TEST(MultiProcessData, SamplerDefaultsAndExactEvalUnderDdprun) {
  const char* ddprun = std::getenv("DDPRUN");
  ASSERT_NE(ddprun, nullptr) << "DDPRUN is not set (run via ctest)";
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  DataLoader one(logits_dataset(), {.batch_size = 7});
  const EvalStats ref = evaluate(one);
  for (int n : {1, 2, 3}) {
    auto r =
        testing::run_command({.argv = {ddprun, "--standalone", "--nproc-per-node",
                                       std::to_string(n), self, "--gtest_also_run_disabled_tests",
                                       "--gtest_filter=MultiProcessData.DISABLED_Worker"},
                              .env = {{"OMP_NUM_THREADS", "1"}},
                              .timeout_s = 60});
    ASSERT_TRUE(r.exited(0)) << r.describe();
    std::map<int, std::vector<int64_t>> shards;
    int evals = 0;
    std::istringstream lines(r.out);
    for (std::string line; std::getline(lines, line);) {
      std::smatch m;
      if (std::regex_search(line, m, std::regex(R"(SHARD (\d+) (\d+)((?: \d+)*))"))) {
        EXPECT_EQ(std::stoi(m[2]), n) << "world size from the default group";
        std::istringstream idx(m[3].str());
        auto& shard = shards[std::stoi(m[1])];
        for (int64_t i; idx >> i;) shard.push_back(i);
      } else if (std::regex_search(line, m, std::regex(R"(EVAL (\d+) (\d+) (\d+) (\S+))"))) {
        ++evals;
        EXPECT_EQ(std::stoll(m[2]), ref.count) << line;
        EXPECT_EQ(std::stoll(m[3]), ref.correct) << line;
        EXPECT_EQ(m[4].str(), fmt::format("{:a}", ref.loss_sum)) << line << " (exact bits)";
      }
    }
    ASSERT_EQ(static_cast<int>(shards.size()), n) << r.describe();
    EXPECT_EQ(evals, n) << r.describe();
    for (auto& [rank, shard] : shards) {
      DistributedSampler expect(kN, {.num_replicas = n, .rank = rank, .seed = kSeed});
      expect.set_epoch(kEpoch);
      EXPECT_EQ(shard, expect.indices()) << "rank " << rank << " of " << n;
    }
  }
}

}  // namespace
}  // namespace ddp
