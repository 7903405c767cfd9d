// ddp-train end to end, as real processes under ddprun: a short run learns and writes its
// files and Debian's python3-torch reproduces the reported accuracy from the saved weights;
// a run resumed at another world size keeps its schedule; a finished run resumed says so;
// flags and a missing dataset get short errors. Faults (kills, corrupt checkpoints,
// preemption) are in test_ddp_train_faults.cpp.
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "train_test_support.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::column;
using testing::Command;
using testing::kData;
using testing::kDdprun;
using testing::kTrain;
using testing::reported_accuracy;
using testing::Result;
using testing::rows;
using testing::run_command;
using testing::TrainTest;

const std::string kEvalScript = testing::env_or_die("EVAL_SCRIPT");

TEST_F(TrainTest, ShortRunLearnsAndWritesItsFilesAndPythonAgrees) {
  Result r = run_command(train("run", {"--model", "mlp", "--epochs", "2"}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  const fs::path run = dir_ / "run";
  for (const char* f : {"metrics.csv", "hparams.json", "model.pt", "model_state.pt",
                        "checkpoints/last.ckpt", "loss.png", "accuracy.png"}) {
    EXPECT_TRUE(fs::exists(run / f)) << f << "\n" << r.describe();
  }
  // The loss falls and the accuracy clears a bar (1536 images, 2 epochs, an MLP).
  const auto loss = column(run / "metrics.csv", "train", 3);
  ASSERT_GE(loss.size(), 4u);
  EXPECT_LT(loss.back(), 0.7 * loss.front()) << "train loss did not fall";
  const auto [correct, total] = reported_accuracy(r.out);
  EXPECT_EQ(total, 1000);
  EXPECT_GE(correct, 700) << "accuracy below 70%";
  // Only rank 0 reports, and says which transport carried the gradients (one host: shm).
  EXPECT_EQ(r.out.find("[rank 1]: done"), std::string::npos);
  EXPECT_NE(r.out.find("2 ranks x 1 thread (LibTorch and BLAS) on the CPU (--device auto: no CUDA device) over shm"),
            std::string::npos)
      << r.out;

  // Debian's python3-torch loads the weights and gets the same count on the same images.
  Result py = run_command({.argv = {"/usr/bin/python3", kEvalScript, "mlp",
                                    (run / "model_state.pt").string(), kData, "1000"},
                           .timeout_s = 120});
  ASSERT_TRUE(py.exited(0)) << py.describe();
  EXPECT_NE(py.out.find(fmt::format("correct {} total 1000", correct)), std::string::npos)
      << py.out << " vs ddp-train's " << correct;
}

TEST_F(TrainTest, SyncBatchNormGradAccumulationAndBf16Run) {
  Result r = run_command(
      train("run", {"--model", "resnet", "--sync-bn", "--grad-accum", "2", "--precision", "bf16",
                    "--epochs", "1", "--max-steps", "8", "--no-plots"}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("done: test accuracy"), std::string::npos) << r.out;
}

// --min-step-ms: every optimizer step lasts at least the floor (the elastic tests' slow jobs).
// metrics.csv's wall time of each step's row (--log-every 1) grows by at least 300 ms a step.
TEST_F(TrainTest, MinStepMsMakesEachStepLastAtLeastTheFloor) {
  Result r = run_command(train("run", {"--model", "mlp", "--epochs", "1", "--max-steps", "5",
                                       "--min-step-ms", "300", "--log-every", "1", "--no-plots"}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  const auto wall = column(dir_ / "run" / "metrics.csv", "train", 7);
  ASSERT_EQ(wall.size(), 5u) << r.out;
  for (size_t i = 1; i < wall.size(); ++i) {
    EXPECT_GE(wall[i] - wall[i - 1], 0.3 - 2e-3) << "step " << i + 1 << " after step " << i;
  }
}

TEST_F(TrainTest, HelpAndBadFlags) {
  Result help = run_command({.argv = {kTrain, "--help"}, .timeout_s = 30});
  ASSERT_TRUE(help.exited(0)) << help.describe();
  for (const char* flag : {"--model", "--grad-accum", "--precision", "--sync-bn", "--resume",
                           "--scale-lr", "--checkpoint-every", "--epochs INT:POSITIVE"}) {
    EXPECT_NE(help.out.find(flag), std::string::npos) << flag;
  }
  // The default as CLI11 2.1 (bookworm) and 2.4 (trixie) print it.
  EXPECT_TRUE(help.out.find("--epochs INT:POSITIVE=3") != std::string::npos ||
              help.out.find("--epochs INT:POSITIVE [3]") != std::string::npos)
      << help.out;
  Result bad = run_command({.argv = {kTrain, "--model", "vgg"}, .timeout_s = 30});
  EXPECT_EQ(bad.exit_code, 2) << bad.describe();
  EXPECT_NE(bad.err.find("--model"), std::string::npos) << bad.err;
  if (!torch::cuda::is_available()) {
    Result fp16 =
        run_command({.argv = {kTrain, "--precision", "fp16", "--output-dir", (dir_ / "x").string()},
                     .timeout_s = 60});
    EXPECT_EQ(fp16.exit_code, 2) << fp16.describe();
    EXPECT_NE(fp16.err.find("needs CUDA"), std::string::npos) << fp16.err;
    // --device cuda without a GPU: one line, before any rendezvous (a 2-rank job ends at once).
    Result cuda = run_command({.argv = {kDdprun, "--standalone", "--nproc-per-node", "2", kTrain,
                                        "--device", "cuda", "--output-dir", (dir_ / "y").string()},
                               .timeout_s = 60});
    EXPECT_NE(cuda.exit_code, 0) << cuda.describe();
    EXPECT_NE((cuda.out + cuda.err).find("--device cuda: no CUDA device is available"),
              std::string::npos)
        << cuda.describe();
    Result alone =
        run_command({.argv = {kTrain, "--device", "cuda", "--output-dir", (dir_ / "z").string()},
                     .timeout_s = 60});
    EXPECT_EQ(alone.exit_code, 2) << alone.describe();
    EXPECT_EQ(std::count(alone.err.begin(), alone.err.end(), '\n'), 1) << alone.err;
  }
  // Numbers: one short line naming the flag, not CLI11's range of doubles.
  Result epochs = run_command({.argv = {kTrain, "--epochs", "-1"}, .timeout_s = 30});
  EXPECT_EQ(epochs.exit_code, 2) << epochs.describe();
  EXPECT_EQ(epochs.err,
            "ddp-train: --epochs: must be a positive integer, got -1 (see ddp-train --help)\n");
  // Sizes past the data: one line and exit 2, before any training (was: a batch of 1e14 was
  // accepted as "1 steps/epoch" and the kernel's OOM killer ended the run).
  for (const auto& [args, want] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--batch-size", "99999999999999"},
            "ddp-train: --batch-size 99999999999999 is larger than each rank's share of the "
            "training set (60000 images at world size 1: 60000 per rank); use at most 60000\n"},
           {{"--train-subset", "100", "--batch-size", "101"},
            "ddp-train: --batch-size 101 is larger than each rank's share of the training set "
            "(100 images at world size 1: 100 per rank); use at most 100\n"},
           {{"--train-subset", "70000"},
            "ddp-train: --train-subset 70000: the train set has 60000 images; use at most 60000 "
            "(0: all of them)\n"},
           {{"--test-subset", "10001"},
            "ddp-train: --test-subset 10001: the test set has 10000 images; use at most 10000 "
            "(0: all of them)\n"},
           {{"--train-subset", "256", "--batch-size", "32", "--grad-accum", "9"},
            "ddp-train: --grad-accum 9 is more micro-batches than an epoch has (8 of 256 images "
            "per rank): each optimizer step would be the whole epoch, not 9 micro-batches; use "
            "at most 8\n"},
           // Counts no machine could mean: one line, before a million threads are started.
           {{"--threads", "1000000"},
            "ddp-train: --threads: must be a non-negative integer no larger than 1024, got "
            "1000000 (see ddp-train --help)\n"},
           {{"--workers", "99999"},
            "ddp-train: --workers: must be a non-negative integer no larger than 256, got 99999 "
            "(see ddp-train --help)\n"},
           {{"--epochs", "99999999999999999999"},
            "ddp-train: --epochs: must be a positive integer no larger than 1000000, got "
            "99999999999999999999 (see ddp-train --help)\n"},
           {{"--comm-hook", "powersgd:0"},
            "ddp-train: --comm-hook: powersgd:RANK needs a whole number from 1 to 1024, not '0' "
            "(see ddp-train --help)\n"},
           {{"--comm-hook", "powersgd", "--powersgd-start", "1"},
            "ddp-train: --powersgd-start: must be an integer of at least 2, got 1 (see "
            "ddp-train --help)\n"},
           {{"--powersgd-start", "50"},
            "ddp-train: --powersgd-start applies to --comm-hook powersgd[:RANK] only (see "
            "ddp-train --help)\n"},
           {{"--grad-accum", "2000000"},
            "ddp-train: --grad-accum: must be a positive integer no larger than 1000000, got "
            "2000000 (see ddp-train --help)\n"}}) {
    std::vector<std::string> argv = {kTrain, "--output-dir", (dir_ / "sizes").string()};
    argv.insert(argv.end(), args.begin(), args.end());
    Result r = run_command({.argv = argv, .timeout_s = 60});
    EXPECT_EQ(r.exit_code, 2) << r.describe();
    EXPECT_EQ(r.err, want) << r.describe();
  }
}

TEST_F(TrainTest, MissingDatasetNamesTheFlagAndThePackageWithOneRankPrefix) {
  Result r = run_command(train("run", {"--data-dir", (dir_ / "nowhere").string()}));
  EXPECT_EQ(r.exit_code, 1) << r.describe();  // ddprun: the group failed
  const std::string want = fmt::format(
      "[rank 0]: ddp-train: Fashion-MNIST not found: {} has no "
      "train-images-idx3-ubyte.gz",
      (dir_ / "nowhere").string());
  EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Check --data-dir"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("dataset-fashion-mnist"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("FashionMnistOptions"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("]: [rank"), std::string::npos) << r.err;
}

// Resumes at `to` ranks a 2-rank run stopped at step 10 and checks the rule of Note [Progress]
// (trainer.h): the rest of the schedule is exactly the end of an uninterrupted run at `to`
// ranks (so the rate neither jumps nor ends early), steps go on counting, both epochs end.
void resume_at_another_world_size(TrainTest& t, const fs::path& dir, int to) {
  const std::vector<std::string> common = {"--model",     "mlp", "--epochs",  "2",
                                           "--log-every", "1",   "--no-plots"};
  const std::string whole = fmt::format("whole{}", to), moved = fmt::format("moved{}", to);
  Result uninterrupted = run_command(t.train(whole, common, to));
  ASSERT_TRUE(uninterrupted.exited(0)) << uninterrupted.describe();
  std::vector<std::string> first = common;
  first.insert(first.end(), {"--max-steps", "10"});
  Result r1 = run_command(t.train(moved, first, 2));
  ASSERT_TRUE(r1.exited(0)) << r1.describe();
  std::vector<std::string> rest = common;
  rest.insert(rest.end(), {"--resume", "auto"});
  Result r2 = run_command(t.train(moved, rest, to));
  ASSERT_TRUE(r2.exited(0)) << r2.describe();
  EXPECT_NE(r2.out.find(fmt::format("written at world size 2, now {}", to)), std::string::npos)
      << r2.out;

  const auto steps = column(dir / moved / "metrics.csv", "train", 0);
  const auto lr = column(dir / moved / "metrics.csv", "train", 5);
  const auto whole_lr = column(dir / whole / "metrics.csv", "train", 5);
  ASSERT_GT(steps.size(), 10u);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i], i + 1.0) << "row " << i;
  // After the resume: the tail of the uninterrupted run's rates, to the last one.
  const std::vector<double> after(lr.begin() + 10, lr.end());
  ASSERT_LE(after.size(), whole_lr.size());
  EXPECT_EQ(after, std::vector<double>(whole_lr.end() - after.size(), whole_lr.end()));
  EXPECT_EQ(lr.back(), whole_lr.back());
  for (double x : lr) EXPECT_GT(x, 0.0);
  // No jump at the resume larger than one step of the uninterrupted run's schedule.
  double largest = 0;
  for (size_t i = 1; i < whole_lr.size(); ++i) {
    largest = std::max(largest, std::abs(whole_lr[i] - whole_lr[i - 1]));
  }
  EXPECT_LE(std::abs(lr[10] - lr[9]), largest) << lr[9] << " then " << lr[10];
  // Both epochs ran to their end: an evaluation of epoch 2 (index 1), and "done".
  const auto tests = rows(dir / moved / "metrics.csv", "test");
  ASSERT_FALSE(tests.empty());
  EXPECT_EQ(tests.back()[1], "1");
  EXPECT_NE(r2.out.find("done: test accuracy"), std::string::npos) << r2.out;
}

TEST_F(TrainTest, ResumedAtFewerRanksKeepsTheSchedule) {
  resume_at_another_world_size(*this, dir_, 1);
}

TEST_F(TrainTest, ResumedAtMoreRanksKeepsTheSchedule) {
  resume_at_another_world_size(*this, dir_, 3);
}

// --zero (Note [ZeRO-1]): the optimizer state sharded over the ranks trains the same bytes as
// the unsharded optimizer; its checkpoint resumes bitwise at the same size and, consolidated,
// at another size exactly as the unsharded run's checkpoint does; the two kinds of checkpoint
// are not mixed up.
TEST_F(TrainTest, ZeroShardsTheOptimizerAndItsCheckpointsResumeAtAnySize) {
  const std::vector<std::string> common = {"--model", "mlp", "--epochs", "1", "--no-plots",
                                           "--seed", "4"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = common;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  Result plain = run_command(train("plain", common));
  ASSERT_TRUE(plain.exited(0)) << plain.describe();
  Result zero = run_command(train("zero", with({"--zero"})));
  ASSERT_TRUE(zero.exited(0)) << zero.describe();
  EXPECT_NE(zero.out.find("adamw (ZeRO-1: state sharded over 2 ranks)"), std::string::npos)
      << zero.out;
  ddp::testing::expect_same_weights(dir_ / "plain" / "model_state.pt", dir_ / "zero" / "model_state.pt");

  // Stopped at step 10, resumed at the same size: the uninterrupted run's bytes.
  ASSERT_TRUE(run_command(train("cut", with({"--zero", "--max-steps", "10"}))).exited(0));
  Result rest = run_command(train("cut", with({"--zero", "--resume", "auto"})));
  ASSERT_TRUE(rest.exited(0)) << rest.describe();
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  ddp::testing::expect_same_weights(dir_ / "zero" / "model_state.pt", dir_ / "cut" / "model_state.pt");

  // Resumed at 3 ranks: the consolidated state re-sharded gives what the unsharded
  // optimizer's checkpoint gives at 3 ranks.
  for (const std::string mode : {"plain3", "zero3"}) {
    const bool z = mode == "zero3";
    std::vector<std::string> first = with({"--max-steps", "10"});
    if (z) first.push_back("--zero");
    ASSERT_TRUE(run_command(train(mode, first)).exited(0));
    std::vector<std::string> then = with({"--resume", "auto"});
    if (z) then.push_back("--zero");
    Result r = run_command(train(mode, then, 3));
    ASSERT_TRUE(r.exited(0)) << r.describe();
    EXPECT_NE(r.out.find("written at world size 2, now 3"), std::string::npos) << r.out;
  }
  ddp::testing::expect_same_weights(dir_ / "plain3" / "model_state.pt", dir_ / "zero3" / "model_state.pt");

  // A checkpoint of the other kind: refused, naming both.
  Result mixed = run_command(train("cut", with({"--resume", "auto", "--epochs", "2"})));
  EXPECT_FALSE(mixed.exited(0)) << mixed.describe();
  EXPECT_NE(mixed.err.find("it holds ddp::ZeroRedundancyOptimizer(torch::optim::AdamW) state "
                           "but this run's optimizer is torch::optim::AdamW"),
            std::string::npos)
      << mixed.describe();
}

// --comm-hook powersgd:RANK (Note [PowerSGD]): compression changes the weights once it starts,
// and a run stopped after it started resumes to the uninterrupted run's bytes (error feedback,
// P and Q come back from the checkpoint); a checkpoint without PowerSGD state is refused.
TEST_F(TrainTest, PowerSGDTrainsAndItsCheckpointsResumeBitwise) {
  const std::vector<std::string> common = {"--model", "mlp", "--epochs", "1", "--no-plots",
                                           "--seed", "5", "--train-subset", "6400",
                                           "--test-subset", "1000"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = common;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  const std::vector<std::string> psgd = {"--comm-hook", "powersgd:2", "--powersgd-start", "10"};
  Result whole = run_command(train("psgd", with(psgd)));
  ASSERT_TRUE(whole.exited(0)) << whole.describe();
  EXPECT_NE(whole.out.find("(PowerSGD rank 2 from step 10)"), std::string::npos) << whole.out;
  ASSERT_TRUE(run_command(train("plain", common)).exited(0));
  EXPECT_FALSE(ddp::testing::same_weights(dir_ / "plain" / "model_state.pt",
                                          dir_ / "psgd" / "model_state.pt"))
      << "PowerSGD trained the same weights as the plain all-reduce: it never compressed";

  auto cut = psgd;
  cut.insert(cut.end(), {"--max-steps", "25"});
  ASSERT_TRUE(run_command(train("cut", with(cut))).exited(0));
  auto rest_args = psgd;
  rest_args.insert(rest_args.end(), {"--resume", "auto"});
  Result rest = run_command(train("cut", with(rest_args)));
  ASSERT_TRUE(rest.exited(0)) << rest.describe();
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  ddp::testing::expect_same_weights(dir_ / "psgd" / "model_state.pt",
                                    dir_ / "cut" / "model_state.pt");

  // The plain run's checkpoint under PowerSGD: refused, naming what is missing.
  auto mixed_args = psgd;
  mixed_args.insert(mixed_args.end(), {"--resume", "auto", "--epochs", "2"});
  Result mixed = run_command(train("plain", with(mixed_args)));
  EXPECT_FALSE(mixed.exited(0)) << mixed.describe();
  EXPECT_NE(mixed.err.find("it holds no PowerSGD state"), std::string::npos) << mixed.describe();
}

// --fsdp zero3 (FullyShardedDataParallel, each layer a Sharded unit): it learns, its final model
// is saved whole under the plain model's names (python3-torch gets the reported count from it);
// stopped and resumed at the same size it ends on the uninterrupted run's bytes, from its
// sharded checkpoints and from one-file ones; at another size it resumes too; flags it cannot
// take are refused; the ResNet with ZeRO-3 blocks learns as DDP does and resumes bitwise.
TEST_F(TrainTest, FsdpTrainsSavesTheWholeModelAndResumesBitwise) {
  const std::vector<std::string> common = {"--model", "mlp", "--epochs", "1",    "--no-plots",
                                           "--seed",  "6",   "--fsdp",   "zero3"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = common;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  Result whole = run_command(train("fsdp", common));
  ASSERT_TRUE(whole.exited(0)) << whole.describe();
  EXPECT_NE(whole.out.find("(FullyShardedDataParallel, ZeRO-3: each layer a unit)"),
            std::string::npos)
      << whole.out;
  const auto [correct, total] = reported_accuracy(whole.out);
  EXPECT_GE(correct, 500) << "accuracy below 50% after one epoch";
  Result py = run_command(
      {.argv = {"/usr/bin/python3", kEvalScript, "mlp", (dir_ / "fsdp" / "model_state.pt").string(),
                kData, std::to_string(total)},
       .timeout_s = 120});
  ASSERT_TRUE(py.exited(0)) << py.describe();
  EXPECT_NE(py.out.find(fmt::format("correct {} total {}", correct, total)), std::string::npos)
      << py.out << " vs ddp-train's " << correct;

  // Sharded checkpoints by default: a directory, each rank's part in its own file.
  ASSERT_TRUE(run_command(train("cut", with({"--max-steps", "10"}))).exited(0));
  const fs::path cut_ckpt = dir_ / "cut" / "checkpoints" / "epoch=0-step=10.ckpt";
  EXPECT_TRUE(fs::is_regular_file(cut_ckpt / "rank-00001.ckpt")) << cut_ckpt;
  EXPECT_TRUE(fs::is_symlink(dir_ / "cut" / "checkpoints" / "last.ckpt"));
  Result rest = run_command(train("cut", with({"--resume", "auto"})));
  ASSERT_TRUE(rest.exited(0)) << rest.describe();
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  ddp::testing::expect_same_weights(dir_ / "fsdp" / "model_state.pt",
                                    dir_ / "cut" / "model_state.pt");
  // One file (--checkpoint-format full), resumed by a run that writes sharded ones: the same.
  ASSERT_TRUE(
      run_command(train("cutfull", with({"--max-steps", "10", "--checkpoint-format", "full"})))
          .exited(0));
  EXPECT_TRUE(fs::is_regular_file(dir_ / "cutfull" / "checkpoints" / "epoch=0-step=10.ckpt"));
  Result rest_full = run_command(train("cutfull", with({"--resume", "auto"})));
  ASSERT_TRUE(rest_full.exited(0)) << rest_full.describe();
  ddp::testing::expect_same_weights(dir_ / "fsdp" / "model_state.pt",
                                    dir_ / "cutfull" / "model_state.pt");

  // Two micro-batches of 16 per step (no_sync on the first) learn as one of 32 does.
  Result accum = run_command(
      train("accum", with({"--fsdp", "zero2", "--grad-accum", "2", "--batch-size", "16"})));
  ASSERT_TRUE(accum.exited(0)) << accum.describe();
  const auto [accum_correct, accum_total] = reported_accuracy(accum.out);
  EXPECT_NEAR(accum_correct, correct, 20) << accum.out;

  // Resumed at 3 ranks: the model and the optimizer's state re-cut at the new shards (what
  // the 2 ranks saved was each one's part); the rest of the epoch trains to where the
  // uninterrupted run got (the steps after the resize have 3 ranks' batches).
  ASSERT_TRUE(run_command(train("three", with({"--max-steps", "10"}))).exited(0));
  Result three = run_command(train("three", with({"--resume", "auto"}), 3));
  ASSERT_TRUE(three.exited(0)) << three.describe();
  EXPECT_NE(three.out.find("written at world size 2, now 3"), std::string::npos) << three.out;
  EXPECT_NEAR(reported_accuracy(three.out).first, correct, 30) << three.out;

  Result both = run_command(train("both", with({"--zero"})));
  EXPECT_FALSE(both.exited(0)) << both.describe();
  EXPECT_NE(both.err.find("--fsdp with --zero"), std::string::npos) << both.describe();

  // The ResNet (BatchNorm in every block) with each residual block a ZeRO-3 unit: it learns as
  // DDP does (the same per-rank batches, so the same statistics; to float tolerance), and a run
  // stopped at step 5 resumes to the uninterrupted run's bytes, running statistics included.
  const std::vector<std::string> resnet = {"--model",    "resnet", "--epochs", "1",
                                           "--no-plots", "--seed", "6"};
  auto resnet_with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = resnet;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  Result rn_ddp = run_command(train("rn_ddp", resnet));
  ASSERT_TRUE(rn_ddp.exited(0)) << rn_ddp.describe();
  Result rn = run_command(train("rn", resnet_with({"--fsdp", "zero3"})));
  ASSERT_TRUE(rn.exited(0)) << rn.describe();
  EXPECT_NEAR(reported_accuracy(rn.out).first, reported_accuracy(rn_ddp.out).first, 10)
      << rn.out << rn_ddp.out;
  ASSERT_TRUE(
      run_command(train("rn_cut", resnet_with({"--fsdp", "zero3", "--max-steps", "5"}))).exited(0));
  Result rn_rest =
      run_command(train("rn_cut", resnet_with({"--fsdp", "zero3", "--resume", "auto"})));
  ASSERT_TRUE(rn_rest.exited(0)) << rn_rest.describe();
  ddp::testing::expect_same_weights(dir_ / "rn" / "model_state.pt",
                                    dir_ / "rn_cut" / "model_state.pt");
}

// --fsdp with --precision bf16: FSDP's mixed precision (units gathered and computed in bf16,
// gradients summed in fp32, fp32 shards stepped). It learns about as fp32 does, and stopped and
// resumed it ends on the uninterrupted run's bytes (the checkpoints hold the fp32 shards).
TEST_F(TrainTest, FsdpInBf16LearnsAndResumesBitwise) {
  const std::vector<std::string> common = {"--model", "mlp", "--epochs", "1",    "--no-plots",
                                           "--seed",  "6",   "--fsdp",   "zero2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = common;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  Result fp32 = run_command(train("fp32", common));
  ASSERT_TRUE(fp32.exited(0)) << fp32.describe();
  Result bf16 = run_command(train("bf16", with({"--precision", "bf16"})));
  ASSERT_TRUE(bf16.exited(0)) << bf16.describe();
  EXPECT_NE(bf16.out.find("ZeRO-2, gathered in bf16, gradients summed in fp32"), std::string::npos)
      << bf16.out;
  EXPECT_NEAR(reported_accuracy(bf16.out).first, reported_accuracy(fp32.out).first, 30)
      << bf16.out << fp32.out;
  ASSERT_TRUE(
      run_command(train("cut", with({"--precision", "bf16", "--max-steps", "10"}))).exited(0));
  Result rest = run_command(train("cut", with({"--precision", "bf16", "--resume", "auto"})));
  ASSERT_TRUE(rest.exited(0)) << rest.describe();
  ddp::testing::expect_same_weights(dir_ / "bf16" / "model_state.pt",
                                    dir_ / "cut" / "model_state.pt");
}

TEST_F(TrainTest, ResumingAFinishedRunReportsItAndTrainsNothing) {
  const std::vector<std::string> common = {"--model", "mlp", "--epochs", "1", "--no-plots"};
  Result done = run_command(train("run", common));
  ASSERT_TRUE(done.exited(0)) << done.describe();
  const auto [correct, total] = reported_accuracy(done.out);
  std::vector<std::string> again = common;
  again.insert(again.end(), {"--resume", "auto"});
  Result r = run_command(train("run", again));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("run already finished at step 24 (epoch 1/1); nothing to do"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(fmt::format("({}/{})", correct, total)), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("(0/0)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("epoch 1/1:"), std::string::npos) << "trained again:\n" << r.out;

  // Stopped by --max-steps mid-epoch: the same, and how to go on.
  std::vector<std::string> part = common;
  part.insert(part.end(), {"--max-steps", "6", "--resume", "auto"});
  ASSERT_TRUE(run_command(train("part", part)).exited(0));
  Result r2 = run_command(train("part", part));
  ASSERT_TRUE(r2.exited(0)) << r2.describe();
  EXPECT_NE(r2.out.find("run already finished at step 6 (--max-steps 6, in epoch 1/1; raise "
                        "--max-steps to train on); nothing to do"),
            std::string::npos)
      << r2.out;
  EXPECT_EQ(r2.out.find("(0/0)"), std::string::npos) << r2.out;
}

}  // namespace
}  // namespace ddp
