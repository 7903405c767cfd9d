// ddp-train's pure parts: the learning-rate schedule, the gradient scaler, the flags.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "config.h"
#include "ddp/error.h"
#include "ddp/process_group.h"
#include "grad_scaler.h"
#include "schedule.h"
#include "support/ranks.h"

namespace ddp::train {
namespace {

TEST(Schedule, WarmupThenCosineToZero) {
  const WarmupCosine s{.peak = 0.1, .warmup_steps = 10, .total_steps = 110};
  EXPECT_DOUBLE_EQ(s.at(0), 0.01);
  EXPECT_DOUBLE_EQ(s.at(9), 0.1);
  EXPECT_DOUBLE_EQ(s.at(10), 0.1);             // decay starts at the peak
  EXPECT_NEAR(s.at(60), 0.05, 1e-12);          // halfway through the decay
  EXPECT_NEAR(s.at(110), 0.0, 1e-12);
  for (int64_t k = 11; k < 110; ++k) EXPECT_LT(s.at(k), s.at(k - 1));
  const WarmupCosine no_warmup{.peak = 1, .warmup_steps = 0, .total_steps = 4};
  EXPECT_DOUBLE_EQ(no_warmup.at(0), 1.0);
}

TEST(GradScaler, UnscalesSkipsOnOverflowAndAdaptsTheScale) {
  auto pg = ddp::testing::one_rank_group();
  GradScaler scaler({.init_scale = 1024, .growth_interval = 2});
  auto p = torch::zeros({3}, torch::requires_grad());
  EXPECT_DOUBLE_EQ(scaler.scale(torch::ones({})).item<double>(), 1024);
  p.mutable_grad() = torch::full({3}, 2048.0);
  EXPECT_TRUE(scaler.unscale_and_check({p}, *pg));
  EXPECT_TRUE(torch::equal(p.grad(), torch::full({3}, 2.0)));
  scaler.update(true);
  EXPECT_DOUBLE_EQ(scaler.current(), 1024);  // one good step: not yet
  scaler.update(true);
  EXPECT_DOUBLE_EQ(scaler.current(), 2048);  // two: grows
  p.mutable_grad() = torch::tensor({1.0f, INFINITY, 0.0f});
  EXPECT_FALSE(scaler.unscale_and_check({p}, *pg));
  scaler.update(false);
  EXPECT_DOUBLE_EQ(scaler.current(), 1024);  // backs off
}

bool parse(std::vector<std::string> args, TrainConfig& c) {
  args.insert(args.begin(), "ddp-train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return parse_args(static_cast<int>(argv.size()), argv.data(), c);
}

TEST(TrainFlags, DefaultsAndValues) {
  TrainConfig c;
  ASSERT_TRUE(parse({}, c));
  EXPECT_EQ(c.model, "cnn");
  EXPECT_EQ(c.epochs, 3);
  ASSERT_TRUE(parse({"--model", "resnet", "--optimizer", "adamw", "--lr", "0.001",
                     "--grad-accum", "4", "--precision", "bf16", "--sync-bn", "--scale-lr",
                     "--resume", "auto", "--no-plots"},
                    c));
  EXPECT_EQ(c.model, "resnet");
  EXPECT_EQ(c.optimizer, "adamw");
  EXPECT_DOUBLE_EQ(c.lr, 0.001);
  EXPECT_EQ(c.grad_accum, 4);
  EXPECT_TRUE(c.sync_bn);
  EXPECT_TRUE(c.scale_lr);
  EXPECT_FALSE(c.plots);
  EXPECT_EQ(c.to_json()["model"], "resnet");
  ASSERT_TRUE(parse({"--epochs", "2", "--epochs", "5"}, c));
  EXPECT_EQ(c.epochs, 5);  // a repeated flag takes its last value, as argparse does
}

TEST(TrainFlags, BadFlagsAndValuesAreClearErrors) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--model", "vgg"}, {"--lr", "-1"}, {"--epochs", "0"}, {"--bogus"},
           {"--precision", "fp8"}, {"--batch-size", "ten"}}) {
    TrainConfig c;
    try {
      parse(args, c);
      ADD_FAILURE() << args[0] << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--help"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace ddp::train
