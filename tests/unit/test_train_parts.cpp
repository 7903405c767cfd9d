// ddp-train's pure parts: the learning-rate schedule, the gradient scaler, the flags, the
// wording of errors, metrics.csv on resume.
#include <cmath>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "config.h"
#include "ddp/error.h"
#include "ddp/process_group.h"
#include "grad_scaler.h"
#include "messages.h"
#include "run_log.h"
#include "schedule.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace ddp::train {
namespace {

TEST(Schedule, WarmupThenCosineToZero) {
  const WarmupCosine s{.peak = 0.1, .warmup_steps = 10, .total_steps = 110};
  EXPECT_DOUBLE_EQ(s.at(0), 0.01);
  EXPECT_DOUBLE_EQ(s.at(9), 0.1);
  EXPECT_DOUBLE_EQ(s.at(10), 0.1);     // decay starts at the peak
  EXPECT_NEAR(s.at(60), 0.05, 1e-12);  // halfway through the decay
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
  ASSERT_TRUE(
      parse({"--model", "resnet", "--optimizer", "adamw", "--lr", "0.001", "--grad-accum", "4",
             "--precision", "bf16", "--sync-bn", "--scale-lr", "--resume", "auto", "--no-plots"},
            c));
  EXPECT_EQ(c.model, "resnet");
  EXPECT_EQ(c.optimizer, Optimizer::kAdamW);
  EXPECT_EQ(c.precision, Precision::kBf16);
  EXPECT_EQ(c.to_json()["precision"], "bf16");
  TrainConfig d;
  ASSERT_TRUE(parse({"--optimizer", "sgd", "--device", "cpu", "--comm-hook", "fp16"}, d));
  EXPECT_EQ(d.optimizer, Optimizer::kSgd);
  EXPECT_EQ(d.device, Device::kCpu);
  EXPECT_EQ(d.comm_hook, CommHook::kFp16);
  EXPECT_EQ(d.precision, Precision::kFp32);  // the default
  EXPECT_EQ(d.to_json()["comm_hook"], "fp16");
  TrainConfig e;
  try {
    parse({"--optimizer", "adam"}, e);
    ADD_FAILURE() << "--optimizer adam accepted";
  } catch (const ConfigError& x) {
    EXPECT_NE(std::string(x.what()).find("--optimizer"), std::string::npos) << x.what();
    EXPECT_NE(std::string(x.what()).find("adam"), std::string::npos) << x.what();
  }
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
  for (const auto& args : std::vector<std::vector<std::string>>{{"--model", "vgg"},
                                                                {"--lr", "-1"},
                                                                {"--epochs", "0"},
                                                                {"--bogus"},
                                                                {"--precision", "fp8"},
                                                                {"--batch-size", "ten"}}) {
    TrainConfig c;
    try {
      parse(args, c);
      ADD_FAILURE() << args[0] << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--help"), std::string::npos) << e.what();
    }
  }
}

std::string parse_error(std::vector<std::string> args) {
  TrainConfig c;
  try {
    parse(std::move(args), c);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(TrainFlags, NumberErrorsAreShortAndNameTheFlag) {
  EXPECT_EQ(parse_error({"--epochs", "-1"}),
            "--epochs: must be a positive integer, got -1 (see ddp-train --help)");
  EXPECT_EQ(parse_error({"--lr", "abc"}),
            "--lr: must be a positive number, got abc (see ddp-train --help)");
  EXPECT_EQ(parse_error({"--batch-size", "0"}),
            "--batch-size: must be a positive integer, got 0 (see ddp-train --help)");
  EXPECT_EQ(parse_error({"--max-steps", "-5"}),
            "--max-steps: must be a non-negative integer, got -5 (see ddp-train --help)");
  EXPECT_EQ(parse_error({"--momentum", "1.5"}),
            "--momentum: must be a number in [0, 1], got 1.5 (see ddp-train --help)");
  EXPECT_EQ(parse_error({"--grad-accum", "99999999999"}),
            "--grad-accum: must be a positive integer no larger than 1000000, got "
            "99999999999 (see ddp-train --help)");
  EXPECT_EQ(parse_error({"--max-steps", "99999999999999999999"}),
            "--max-steps: must be a non-negative integer no larger than 9223372036854775807, "
            "got 99999999999999999999 (see ddp-train --help)");
  EXPECT_EQ(parse_error({"--min-step-ms", "60001"}),
            "--min-step-ms: must be a non-negative integer no larger than 60000, got 60001 (see "
            "ddp-train --help)");
  EXPECT_EQ(parse_error({"--lr", "nan"}),
            "--lr: must be a positive number, got nan (see ddp-train --help)");
  EXPECT_EQ(parse_error({"--epochs", "2.5"}),
            "--epochs: must be a positive integer, got 2.5 (see ddp-train --help)");
  TrainConfig c;
  ASSERT_TRUE(parse({"--momentum", "0", "--weight-decay", "0", "--max-steps", "0", "--lr", "1e-4",
                     "--seed", "7"},
                    c));
  EXPECT_DOUBLE_EQ(c.lr, 1e-4);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.min_step_ms, 0);  // no floor unless asked
  ASSERT_TRUE(parse({"--min-step-ms", "250"}, c));
  EXPECT_EQ(c.min_step_ms, 250);
  EXPECT_EQ(c.to_json()["min_step_ms"], 250);
}

TEST(TrainMessages, OnlyThisRanksOwnPrefixIsDropped) {
  EXPECT_EQ(error_text("[rank 1] checkpoint save: rank 0 failed", 1),
            "checkpoint save: rank 0 failed");
  // Relayed from another rank: the origin stays.
  EXPECT_EQ(error_text("[rank 0] DistributedDataParallel: x", 1),
            "[rank 0] DistributedDataParallel: x");
  EXPECT_EQ(error_text("Fashion-MNIST not found", 0), "Fashion-MNIST not found");
  EXPECT_EQ(error_text("[rank 12] x", 1), "[rank 12] x");
}

TEST(RunLog, DropAfterKeepsTheRowsUpToTheStepThenAppends) {
  namespace fs = std::filesystem;
  const fs::path dir = ddp::testing::make_temp_dir("run_log_test");
  {
    RunLog log(dir, nullptr);
    for (int64_t s = 1; s <= 6; ++s) log.append({.step = s, .split = "train", .loss = 1});
    log.append({.step = 4, .split = "test", .loss = 1, .accuracy = 0.5});
  }
  {
    std::ofstream(dir / "metrics.csv", std::ios::app) << "3,0,tra";  // cut off by a kill
  }
  RunLog log(dir, nullptr);         // as a resumed run opens it
  EXPECT_EQ(log.drop_after(4), 3);  // steps 5, 6 and the half row
  log.append({.step = 5, .split = "train", .loss = 2});
  // "step,split" of each row.
  std::ifstream in(dir / "metrics.csv");
  std::vector<std::string> rows;
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line.rfind("step,epoch,split", 0), 0u) << line;
  while (std::getline(in, line)) {
    const size_t a = line.find(','), b = line.find(',', a + 1), c = line.find(',', b + 1);
    rows.push_back(line.substr(0, a) + line.substr(b, c - b));
  }
  EXPECT_EQ(rows, (std::vector<std::string>{"1,train", "2,train", "3,train", "4,train", "4,test",
                                            "5,train"}));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace ddp::train
