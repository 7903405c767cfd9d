// ddp-train end to end, as real processes under ddprun: a short run learns and writes its
// files; a run killed mid-epoch and resumed ends bit for bit where an uninterrupted run does;
// corrupt checkpoints are skipped with a reason; another model's checkpoint is refused;
// Debian's python3-torch reproduces the reported accuracy from the saved weights.
#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/saved_state.h"
#include "support/subprocess.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Command;
using testing::Result;
using testing::run_command;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kTrain = testing::env_or_die("DDP_TRAIN");
const std::string kEvalScript = testing::env_or_die("EVAL_SCRIPT");
const std::string kData = "/usr/share/datasets/fashion-mnist";

class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ddp_train_test_XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // ddprun --standalone --nproc-per-node 2 ddp-train <small, fast settings> <extra>
  Command train(const std::string& out, std::vector<std::string> extra, int ranks = 2) {
    std::vector<std::string> argv = {kDdprun, "--standalone", "--nproc-per-node",
                                     std::to_string(ranks), kTrain,
                                     "--train-subset", "1536", "--test-subset", "1000",
                                     "--batch-size", "32", "--output-dir", (dir_ / out).string(),
                                     "--log-every", "4", "--workers", "1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return {.argv = argv, .timeout_s = 240};
  }

  fs::path dir_;
};

// "test accuracy 81.20% (812/1000)" from the last "done:" line.
std::pair<int, int> reported_accuracy(const std::string& out) {
  std::smatch m;
  std::regex re(R"(done: test accuracy [0-9.]+% \((\d+)/(\d+)\))");
  EXPECT_TRUE(std::regex_search(out, m, re)) << out;
  return m.empty() ? std::pair{-1, -1} : std::pair{std::stoi(m[1]), std::stoi(m[2])};
}

std::vector<double> column(const fs::path& csv, const std::string& split, int col) {
  std::ifstream in(csv);
  std::string line;
  std::vector<double> values;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
    if (cells.size() > static_cast<size_t>(col) && cells[2] == split) {
      values.push_back(std::stod(cells[col]));
    }
  }
  return values;
}

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
  EXPECT_NE(r.out.find("2 ranks x 1 threads over shm"), std::string::npos) << r.out;

  // Debian's python3-torch loads the weights and gets the same count on the same images.
  Result py = run_command({.argv = {"/usr/bin/python3", kEvalScript, "mlp",
                                    (run / "model_state.pt").string(), kData, "1000"},
                           .timeout_s = 120});
  ASSERT_TRUE(py.exited(0)) << py.describe();
  EXPECT_NE(py.out.find(fmt::format("correct {} total 1000", correct)), std::string::npos)
      << py.out << " vs ddp-train's " << correct;
}

TEST_F(TrainTest, KilledMidEpochAndResumedEndsBitwiseIdentical) {
  // The CNN has dropout (RNG) and BatchNorm (buffers): the hard case for exact resume.
  const std::vector<std::string> common = {"--model", "cnn", "--epochs", "2",
                                           "--checkpoint-every", "5", "--no-plots"};
  Result whole = run_command(train("whole", common));
  ASSERT_TRUE(whole.exited(0)) << whole.describe();

  auto first = testing::Subprocess::start(train("killed", common));
  // Kill once a mid-epoch checkpoint exists (24 steps per epoch here; 10 is mid-epoch 1).
  const fs::path ckpt = dir_ / "killed" / "checkpoints" / "epoch=0-step=10.ckpt";
  ASSERT_TRUE(testing::wait_until([&] { return fs::exists(ckpt); }, 200))
      << first.err_so_far();
  ::kill(first.pid(), SIGKILL);  // ddprun dies; its workers die with it (PR_SET_PDEATHSIG)
  first.wait();

  std::vector<std::string> resume = common;
  resume.insert(resume.end(), {"--resume", "auto"});
  Result resumed = run_command(train("killed", resume));
  ASSERT_TRUE(resumed.exited(0)) << resumed.describe();
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;

  auto a = testing::load_state(dir_ / "whole" / "model_state.pt");
  auto b = testing::load_state(dir_ / "killed" / "model_state.pt");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) {
    EXPECT_TRUE(torch::equal(tensor, b.at(name))) << name << " differs after resume";
  }
}

TEST_F(TrainTest, CorruptNewestCheckpointIsSkippedAndOtherModelsAreRefused) {
  const std::vector<std::string> common = {"--model", "mlp", "--epochs", "1",
                                           "--checkpoint-every", "6", "--no-plots",
                                           "--max-steps", "18"};
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
  std::vector<std::string> other = {"--model", "cnn", "--epochs", "1", "--no-plots",
                                    "--resume", (ckpts / "epoch=0-step=12.ckpt").string()};
  Result refused = run_command(train("run", other));
  EXPECT_EQ(refused.exit_code, 1) << refused.describe();
  EXPECT_NE(refused.err.find("--model mlp"), std::string::npos) << refused.err;
}

TEST_F(TrainTest, SyncBatchNormGradAccumulationAndBf16Run) {
  Result r = run_command(train("run", {"--model", "resnet", "--sync-bn", "--grad-accum", "2",
                                       "--precision", "bf16", "--epochs", "1", "--max-steps",
                                       "8", "--no-plots"}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("done: test accuracy"), std::string::npos) << r.out;
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
  Result fp16 = run_command({.argv = {kTrain, "--precision", "fp16", "--output-dir",
                                      (dir_ / "x").string()},
                             .timeout_s = 60});
  EXPECT_EQ(fp16.exit_code, 2) << fp16.describe();
  EXPECT_NE(fp16.err.find("needs CUDA"), std::string::npos) << fp16.err;
}

}  // namespace
}  // namespace ddp
