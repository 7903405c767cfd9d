// ddp-train under faults, as real processes under ddprun: a run killed mid-epoch and resumed
// ends bit for bit where an uninterrupted run does (also --fsdp zero3 from its sharded
// checkpoints), and its metrics.csv does not repeat steps;
// corrupt checkpoints are skipped with a reason, and when all are corrupt the resume is refused;
// another model's checkpoint is refused; preempted by SIGTERM it stops after an agreed step
// with a checkpoint and the resume is exact; a second SIGTERM or the end of the grace period
// still kills; a worker SIGKILLed mid-epoch under --max-restarts is restarted and the group
// resumes on its own, bit for bit.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "train_test_support.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::column;
using testing::Result;
using testing::run_command;
using testing::Subprocess;
using testing::TrainTest;
using testing::wait_until;

// The CNN has dropout (RNG) and BatchNorm (buffers): the hard case for exact resume. 24 steps
// per epoch here; about 1.5 s per epoch on 2 cores.
const std::vector<std::string> kCnn =
    {"--model", "cnn", "--epochs", "2", "--checkpoint-every", "5", "--no-plots"};

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The final weights of an uninterrupted run of kCnn, made once for the suite.
class TrainFaultTest : public TrainTest {
 protected:
  static void SetUpTestSuite() {
    whole_dir_ = ddp::testing::make_temp_dir("ddp_train_whole");
    Result r = run_command(testing::train_command(whole_dir_, "whole", kCnn));
    whole_ok_ = r.exited(0);
    if (!whole_ok_) whole_error_ = r.describe();
  }
  static void TearDownTestSuite() { fs::remove_all(whole_dir_); }

  static fs::path whole() { return whole_dir_ / "whole"; }
  static inline fs::path whole_dir_;
  static inline bool whole_ok_ = false;
  static inline std::string whole_error_;
};

// ddprun's worker processes (its children), in start order.
std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/task/{}/children", pid, pid));
  std::vector<pid_t> out;
  for (pid_t p; in >> p;) out.push_back(p);
  return out;
}

TEST_F(TrainFaultTest, KilledMidEpochAndResumedEndsBitwiseIdentical) {
  ASSERT_TRUE(whole_ok_) << whole_error_;
  const std::vector<std::string> common = kCnn;

  auto first = testing::Subprocess::start(train("killed", common));
  // Kill once a mid-epoch checkpoint exists (24 steps per epoch here; 10 is mid-epoch 1).
  const fs::path ckpt = dir_ / "killed" / "checkpoints" / "epoch=0-step=10.ckpt";
  ASSERT_TRUE(testing::wait_until([&] { return fs::exists(ckpt); }, 200)) << first.err_so_far();
  ::kill(first.pid(), SIGKILL);  // ddprun dies; its workers die with it (PR_SET_PDEATHSIG)
  first.wait();

  std::vector<std::string> resume = common;
  resume.insert(resume.end(), {"--resume", "auto"});
  Result resumed = run_command(train("killed", resume));
  ASSERT_TRUE(resumed.exited(0)) << resumed.describe();
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;

  testing::expect_same_weights(whole() / "model_state.pt", dir_ / "killed" / "model_state.pt");
  // The killed attempt's rows after its checkpoint are gone: the steps are the whole run's.
  EXPECT_EQ(column(dir_ / "killed" / "metrics.csv", "train", 0),
            column(whole() / "metrics.csv", "train", 0));
}

// --fsdp zero3 on the CNN (dropout, BatchNorm whose statistics each rank keeps): SIGKILLed once
// its sharded checkpoint of step 10 is published, then resumed, it ends on the bytes (weights and
// running statistics) of an uninterrupted FSDP run.
TEST_F(TrainFaultTest, FsdpKilledMidEpochAndResumedEndsBitwiseIdentical) {
  const std::vector<std::string> fsdp = plus(kCnn, {"--fsdp", "zero3"});
  Result uninterrupted = run_command(train("fsdp_whole", fsdp));
  ASSERT_TRUE(uninterrupted.exited(0)) << uninterrupted.describe();

  auto first = testing::Subprocess::start(train("killed", fsdp));
  const fs::path ckpt = dir_ / "killed" / "checkpoints" / "epoch=0-step=10.ckpt";
  ASSERT_TRUE(testing::wait_until([&] { return fs::exists(ckpt); }, 200)) << first.err_so_far();
  ::kill(first.pid(), SIGKILL);
  first.wait();
  EXPECT_TRUE(fs::is_regular_file(ckpt / "rank-00001.ckpt"));  // published whole, or not at all

  Result resumed = run_command(train("killed", plus(fsdp, {"--resume", "auto"})));
  ASSERT_TRUE(resumed.exited(0)) << resumed.describe();
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;
  testing::expect_same_weights(dir_ / "fsdp_whole" / "model_state.pt",
                               dir_ / "killed" / "model_state.pt");
}

TEST_F(TrainFaultTest, CorruptNewestCheckpointIsSkippedAndOtherModelsAreRefused) {
  const std::vector<std::string> common =
      {"--model", "mlp",        "--epochs",    "1", "--checkpoint-every",
       "6",       "--no-plots", "--max-steps", "18"};
  Result r = run_command(train("run", common));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  const fs::path newest = ckpts / "epoch=0-step=18.ckpt";
  ASSERT_TRUE(fs::exists(newest)) << r.describe();
  fs::resize_file(newest, fs::file_size(newest) / 2);  // also truncates last.ckpt (hard link)

  std::vector<std::string> resume = common;
  resume.insert(resume.end(), {"--resume", "auto", "--max-steps", "24"});
  Result again = run_command(train("run", resume));
  ASSERT_TRUE(again.exited(0)) << again.describe();
  EXPECT_NE(again.out.find("skipped"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("truncated"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("epoch=0-step=12.ckpt at epoch 0, step 12"), std::string::npos)
      << again.out;

  // A CNN run pointed at the MLP's checkpoints is refused, with the reason.
  std::vector<std::string> other = {"--model",
                                    "cnn",
                                    "--epochs",
                                    "1",
                                    "--no-plots",
                                    "--resume",
                                    (ckpts / "epoch=0-step=12.ckpt").string()};
  Result refused = run_command(train("run", other));
  EXPECT_EQ(refused.exit_code, 1) << refused.describe();
  EXPECT_NE(refused.err.find("--model mlp"), std::string::npos) << refused.err;
  // One rank prefix per line: ddprun's (Note [One rank prefix] in messages.h).
  EXPECT_EQ(refused.err.find("[rank 0]: [rank 0]"), std::string::npos) << refused.err;
  EXPECT_EQ(refused.err.find("ddp-train: [rank 0]"), std::string::npos) << refused.err;
}

TEST_F(TrainFaultTest, EveryCheckpointCorruptIsRefusedNamingEachFile) {
  const std::vector<std::string> common = {"--model", "mlp",         "--epochs",
                                           "1",       "--no-plots",  "--checkpoint-every",
                                           "6",       "--max-steps", "12"};
  ASSERT_TRUE(run_command(train("run", common)).exited(0));
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  fs::resize_file(ckpts / "epoch=0-step=6.ckpt", 100);
  fs::resize_file(ckpts / "epoch=0-step=12.ckpt", 1000);  // and last.ckpt, its hard link
  std::vector<std::string> again = common;
  again.insert(again.end(), {"--resume", "auto", "--max-steps", "18"});
  // Under --max-restarts the refusal (exit code 2) is not restarted: it would repeat.
  Result r = run_command(train("run", again, 2, {"--max-restarts", "2"}));
  EXPECT_EQ(r.exit_code, 1) << r.describe();  // ddprun: the group failed (workers: 2)
  EXPECT_NE(r.err.find("not restarting (2 restart(s) left)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("restarting it"), std::string::npos) << r.err;
  for (const char* want : {"--resume auto: none of the 2 checkpoint(s) in",
                           "epoch=0-step=12.ckpt: ", "epoch=0-step=6.ckpt: ", "truncated",
                           "not starting over from step 0", "move or delete that folder"}) {
    EXPECT_NE(r.err.find(want), std::string::npos) << want << "\n" << r.err;
  }
  EXPECT_NE(r.err.find("exit code 2"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("epoch 1/1"), std::string::npos) << "trained:\n" << r.out;
}

TEST_F(TrainFaultTest, MetricsRowsAfterTheResumedCheckpointAreDropped) {
  const std::vector<std::string> common = {"--model",     "mlp", "--epochs",           "1",
                                           "--log-every", "1",   "--checkpoint-every", "5",
                                           "--no-plots"};
  std::vector<std::string> first = common;
  first.insert(first.end(), {"--max-steps", "12"});
  ASSERT_TRUE(run_command(train("run", first)).exited(0));
  // Step 12's checkpoint (and last.ckpt, its hard link) damaged: the resume starts at 10, after
  // rows for steps 11 and 12 (and step 12's evaluation) were written.
  const fs::path newest = dir_ / "run" / "checkpoints" / "epoch=0-step=12.ckpt";
  fs::resize_file(newest, fs::file_size(newest) / 2);
  std::vector<std::string> again = common;
  again.insert(again.end(), {"--max-steps", "14", "--resume", "auto"});
  Result r = run_command(train("run", again));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("metrics.csv: dropped 3 row(s) after step 10"), std::string::npos) << r.out;
  std::vector<double> want;
  for (int s = 1; s <= 14; ++s) want.push_back(s);
  EXPECT_EQ(column(dir_ / "run" / "metrics.csv", "train", 0), want);
  EXPECT_EQ(column(dir_ / "run" / "metrics.csv", "test", 0), std::vector<double>{14});
}

TEST_F(TrainFaultTest, PreemptedBySigtermCheckpointsAndResumesBitwise) {
  ASSERT_TRUE(whole_ok_) << whole_error_;
  auto first = Subprocess::start(train("run", kCnn));
  const fs::path ckpt = dir_ / "run" / "checkpoints" / "epoch=0-step=10.ckpt";
  ASSERT_TRUE(wait_until([&] { return fs::exists(ckpt); }, 200)) << first.err_so_far();
  first.signal(SIGTERM);  // what a scheduler sends ddprun before a reclaim
  const double signalled = first.elapsed_s();
  const Result& r = first.wait();
  // ddprun ends by the signal it got, as torchrun does; the workers stopped well inside the
  // 10 s grace period, after an agreed step with its checkpoint.
  EXPECT_EQ(r.term_signal, SIGTERM) << r.describe();
  EXPECT_LT(r.wall_s - signalled, 8.0) << r.describe();
  std::smatch m;
  ASSERT_TRUE(
      std::regex_search(r.out, m,
                        std::regex(R"(preempted at step (\d+) \(epoch 1/2\); checkpoint (\S+); )"
                                   R"(resume with --resume auto)")))
      << r.describe();
  const int step = std::stoi(m[1]);
  EXPECT_GE(step, 10);  // SIGTERM came after step 10's checkpoint
  EXPECT_LT(step, 24);
  EXPECT_EQ(fs::path(m[2].str()).filename(), fmt::format("epoch=0-step={}.ckpt", step));
  EXPECT_TRUE(fs::exists(m[2].str()));
  fmt::print("preempted at step {}; ddprun ended {:.2f} s after SIGTERM\n", step,
             r.wall_s - signalled);

  Result resumed = run_command(train("run", plus(kCnn, {"--resume", "auto"})));
  ASSERT_TRUE(resumed.exited(0)) << resumed.describe();
  EXPECT_NE(resumed.out.find(fmt::format("resumed from {} at epoch 0, step {}", m[2].str(), step)),
            std::string::npos)
      << resumed.out;
  testing::expect_same_weights(whole() / "model_state.pt", dir_ / "run" / "model_state.pt");
  EXPECT_EQ(column(dir_ / "run" / "metrics.csv", "train", 0),
            column(whole() / "metrics.csv", "train", 0));
}

// Slow steps (a ResNet on 1024 images per step, about 2 s on one thread), so that signals land
// inside a step.
const std::vector<std::string> kSlowSteps =
    {"--model", "resnet",     "--batch-size", "1024", "--train-subset", "8192", "--test-subset",
     "100",     "--no-plots", "--threads",    "1"};

TEST_F(TrainFaultTest, SecondSigtermKillsAtOnce) {
  // ddp-train alone (one process): the first SIGTERM asks for a stop after the step, the
  // second kills.
  std::vector<std::string> argv =
      plus({testing::kTrain, "--output-dir", (dir_ / "run").string()}, kSlowSteps);
  auto p = Subprocess::start({.argv = argv, .timeout_s = 120});
  ASSERT_TRUE(wait_until([&] { return p.out_so_far().find("BLAS:") != std::string::npos; }, 60))
      << p.out_so_far() << p.err_so_far();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // into the first step
  p.signal(SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  p.signal(SIGTERM);
  const double second = p.elapsed_s();
  const Result& r = p.wait();
  EXPECT_EQ(r.term_signal, SIGTERM) << r.describe();
  EXPECT_LT(r.wall_s - second, 1.0) << r.describe();
  EXPECT_EQ(r.out.find("preempted"), std::string::npos) << r.out;
}

TEST_F(TrainFaultTest, OneSigtermAloneStopsAfterTheStepWithCode75) {
  std::vector<std::string> argv =
      plus({testing::kTrain, "--output-dir", (dir_ / "run").string()}, kSlowSteps);
  auto p = Subprocess::start({.argv = argv, .timeout_s = 120});
  ASSERT_TRUE(wait_until([&] { return p.out_so_far().find("BLAS:") != std::string::npos; }, 60))
      << p.out_so_far() << p.err_so_far();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  p.signal(SIGTERM);
  const Result& r = p.wait();
  EXPECT_TRUE(r.exited(75)) << r.describe();
  EXPECT_NE(r.out.find("preempted at step 1 (epoch 1/3); checkpoint "), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir_ / "run" / "checkpoints" / "epoch=0-step=1.ckpt"));
}

TEST_F(TrainFaultTest, GracePeriodEndStillKills) {
  // The step outlasts ddprun's grace period: SIGKILL ends it on time.
  auto p = Subprocess::start(train("run", kSlowSteps, 2, {"--grace-period", "0.5"}));
  ASSERT_TRUE(wait_until([&] { return p.out_so_far().find("BLAS:") != std::string::npos; }, 60))
      << p.out_so_far() << p.err_so_far();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  p.signal(SIGTERM);
  const double signalled = p.elapsed_s();
  const Result& r = p.wait();
  EXPECT_EQ(r.term_signal, SIGTERM) << r.describe();
  // Killed at the grace period's end, mid-step: no preemption line, no checkpoint.
  EXPECT_GT(r.wall_s - signalled, 0.4) << r.describe();
  EXPECT_LT(r.wall_s - signalled, 1.5) << r.describe();
  EXPECT_NE(r.err.find("(SIGKILL in 0.5s)"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("preempted"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "run" / "checkpoints" / "epoch=0-step=1.ckpt"));
}

TEST_F(TrainFaultTest, KilledWorkerIsRestartedAndTheGroupResumesBitwise) {
  ASSERT_TRUE(whole_ok_) << whole_error_;
  auto p =
      Subprocess::start(train("run", plus(kCnn, {"--resume", "auto"}), 2, {"--max-restarts", "2"}));
  const fs::path ckpt = dir_ / "run" / "checkpoints" / "epoch=0-step=10.ckpt";
  ASSERT_TRUE(wait_until([&] { return fs::exists(ckpt); }, 200)) << p.err_so_far();
  const std::vector<pid_t> workers = children_of(p.pid());
  ASSERT_EQ(workers.size(), 2u) << p.err_so_far();
  ::kill(workers[1], SIGKILL);  // rank 1, mid-epoch
  const Result& r = p.wait();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.err.find("restarting it (restart 1 of 2)"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << r.out;
  testing::expect_same_weights(whole() / "model_state.pt", dir_ / "run" / "model_state.pt");
  EXPECT_EQ(column(dir_ / "run" / "metrics.csv", "train", 0),
            column(whole() / "metrics.csv", "train", 0));
}

}  // namespace
}  // namespace ddp
