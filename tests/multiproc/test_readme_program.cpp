// The README's program (examples/readme_train) as a user runs it: 3 ranks under ddprun over
// Gloo, SIGKILLed mid-epoch after a checkpoint, started again: it resumes (the TrainingState
// with the DDP wrapper, the optimizer, the sampler, the generators) and ends with the bytes of
// an uninterrupted run. Over Gloo at world size 3 (a ring) where a gradient sits in DDP's
// buckets changes the last bits of its sum, so a resume that lost DDP's rebuilt bucket order
// would not end equal (tests/collective/test_checkpoint_collective.cpp shows that on a model
// whose gradients arrive out of registration order).
#include <signal.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Command;
using testing::Result;

// The program's model (examples/readme_train/main.cpp), to read model.pt back.
struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv{register_module("conv", torch::nn::Conv2d(1, 16, 3))};
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(16 * 13 * 13, 128))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(128, 10))};
};
TORCH_MODULE(Net);

constexpr const char* kFashionMnist = "/usr/share/datasets/fashion-mnist";

class ReadmeProgram : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kFashionMnist)) GTEST_SKIP() << "needs dataset-fashion-mnist";
    dir_ = testing::make_temp_dir("readme_program");
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // ddprun --standalone --nproc-per-node 3 readme_train 1 <run>/checkpoints, in <run>.
  Command command(const std::string& run) const {
    fs::create_directories(dir_ / run);
    Command c;
    c.argv = {"/bin/sh",
              "-c",
              "cd \"$0\" && exec \"$1\" --standalone --nproc-per-node 3 \"$2\" 1 checkpoints",
              (dir_ / run).string(),
              testing::env_or_die("DDPRUN"),
              testing::env_or_die("README_TRAIN")};
    c.env = {{"DDP_BACKEND", "gloo"}};
    c.timeout_s = 240;
    return c;
  }

  Net model_of(const std::string& run) const {
    Net net;
    torch::load(net, (dir_ / run / "model.pt").string());
    return net;
  }

  fs::path dir_;
};

TEST_F(ReadmeProgram, KilledMidEpochAndStartedAgainEndsBitwiseEqual) {
  const Result whole = testing::run_command(command("whole"));
  ASSERT_TRUE(whole.exited(0)) << whole.describe();

  // Killed once the checkpoint of step 200 is written (313 steps in the epoch at 3 ranks).
  auto first = testing::Subprocess::start(command("killed"));
  const fs::path ckpt = dir_ / "killed" / "checkpoints" / "epoch=0-step=200.ckpt";
  ASSERT_TRUE(testing::wait_until([&] { return fs::exists(ckpt); }, 200)) << first.err_so_far();
  ::kill(first.pid(), SIGKILL);  // ddprun dies; its workers die with it (PR_SET_PDEATHSIG)
  first.wait();
  ASSERT_FALSE(fs::exists(dir_ / "killed" / "model.pt")) << "the run ended before the kill";

  const Result resumed = testing::run_command(command("killed"));
  ASSERT_TRUE(resumed.exited(0)) << resumed.describe();
  const Net a = model_of("whole"), b = model_of("killed");
  const auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& p : pa) {
    EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key() << " differs after the resume";
  }
}

}  // namespace
}  // namespace ddp
