// Exact distributed evaluation: ranks as threads at world sizes 1, 2, 3 over a dataset whose
// size (101) no world size divides; the reduced loss sum, accuracy and count equal a
// single-process evaluation exactly, and a padded (training) sampler would not.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/data_loader.h"
#include "ddp/error.h"
#include "ddp/metrics.h"
#include "support/ranks.h"

namespace ddp {
namespace {

using testing::run_ranks;

constexpr int64_t kN = 101;
constexpr int64_t kClasses = 10;

// "Model outputs" as the dataset: random logits and targets, so evaluation needs no model and
// each sample's loss depends on its own row only.
std::shared_ptr<TensorDataset> logits_dataset() {
  torch::manual_seed(1234);
  auto logits = torch::randn({kN, kClasses}) * 3;
  auto targets = torch::randint(kClasses, {kN}, torch::kLong);
  return std::make_shared<TensorDataset>(logits, targets);
}

EvalStats evaluate(DataLoader& loader) {
  EvalStats s;
  for (auto& b : loader) {
    auto logp = torch::log_softmax(b.data, 1);
    auto loss = torch::nll_loss(logp, b.target, {}, at::Reduction::None);  // [B]
    s.add(logp, b.target, loss);
  }
  return s;
}

EvalStats single_process_reference(const std::shared_ptr<TensorDataset>& data) {
  DataLoader loader(data, {.batch_size = 7});
  return evaluate(loader);
}

class ExactEval : public ::testing::TestWithParam<int> {};

TEST_P(ExactEval, ReducedMetricsEqualTheSingleProcessValues) {
  const int world = GetParam();
  auto data = logits_dataset();
  const EvalStats ref = single_process_reference(data);
  ASSERT_EQ(ref.count, kN);
  ASSERT_GT(ref.correct, 0);
  run_ranks(world, [&](ProcessGroup& pg) {
    for (bool shuffle : {false, true}) {
      DistributedSampler sampler(kN, {.num_replicas = pg.size(),
                                      .rank = pg.rank(),
                                      .shuffle = shuffle,
                                      .pad = false});
      DataLoader loader(data, sampler, {.batch_size = 8, .num_workers = 1});
      const EvalStats all = all_reduce(evaluate(loader), pg);
      EXPECT_EQ(all.count, ref.count) << "rank " << pg.rank();
      EXPECT_EQ(all.correct, ref.correct);
      EXPECT_EQ(all.loss_sum, ref.loss_sum);  // exact, not near
      EXPECT_EQ(all.accuracy(), ref.accuracy());
      EXPECT_EQ(all.mean_loss(), ref.mean_loss());
    }
    // The training sampler pads to a multiple of the world size: duplicates get counted.
    DistributedSampler padded(kN, {.num_replicas = pg.size(), .rank = pg.rank()});
    DataLoader loader(data, padded, {.batch_size = 8});
    const EvalStats wrong = all_reduce(evaluate(loader), pg);
    EXPECT_EQ(wrong.count, (kN + pg.size() - 1) / pg.size() * pg.size());
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ExactEval, ::testing::Values(1, 2, 3));

TEST(EvalStats, AddChecksShapesAndAllReduceWithoutAGroupIsLocal) {
  EvalStats s;
  s.add(torch::tensor({{0.1, 0.9}, {0.8, 0.2}}), torch::tensor({1, 1}),
        torch::tensor({0.5f, 1.5f}));
  EXPECT_EQ(s.count, 2);
  EXPECT_EQ(s.correct, 1);
  EXPECT_EQ(s.loss_sum, 2.0);
  EXPECT_EQ(s.accuracy(), 0.5);
  EXPECT_EQ(s.mean_loss(), 1.0);
  EXPECT_THROW(s.add(torch::zeros({2, 2}), torch::zeros({3}, torch::kLong)), ConfigError);
  EXPECT_THROW(s.add(torch::zeros({2, 2}), torch::zeros({2}, torch::kLong), torch::zeros({})),
               ConfigError);             // a mean loss cannot be reduced exactly
  const EvalStats same = all_reduce(s);  // no default group: world size 1
  EXPECT_EQ(same.count, 2);
  EXPECT_EQ(EvalStats{}.accuracy(), 0.0);
}

}  // namespace
}  // namespace ddp
