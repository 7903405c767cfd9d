// Under a real Slurm (tests/support/slurm.h: slurmctld, slurmd and munged of the test's own):
// srun starting the ranks, srun starting one ddprun per node, a batch job preempted and
// requeued, and setups that cannot work. The same seed trains to the same bytes whichever way
// the job was started (the ranks' threads reach the BLAS whatever launched them).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "support/slurm.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using ddp::testing::Result;
using ddp::testing::SlurmCluster;
using ddp::testing::Subprocess;

const std::string kDdprun = ddp::testing::env_or_die("DDPRUN");
const std::string kTrain = ddp::testing::env_or_die("DDP_TRAIN");
constexpr const char* kSrun = "/usr/bin/srun";

std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class Slurm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (auto why = SlurmCluster::unavailable()) {
      skip_ = new std::string(*why);
      return;
    }
    dir_ = new fs::path(ddp::testing::make_temp_dir("ddp_slurm_runs"));
    cluster_ = new SlurmCluster();
  }
  static void TearDownTestSuite() {
    delete cluster_;  // every job cancelled, the daemons stopped
    if (dir_ != nullptr) fs::remove_all(*dir_);
    delete dir_;
    delete skip_;
  }
  void SetUp() override {
    if (skip_ != nullptr) GTEST_SKIP() << *skip_;
  }

  // A short run of the MLP: 8 steps at world 2.
  static std::vector<std::string> mlp(const std::string& out) {
    return {kTrain,         "--model",    "mlp", "--train-subset", "512", "--test-subset",
            "200",          "--batch-size", "32", "--epochs",      "1",   "--workers",
            "1",            "--seed",     "3",   "--no-plots",     "--output-dir",
            (*dir_ / out).string()};
  }

  // The MLP run under ddprun on this host (ddprun sets OMP_NUM_THREADS; srun does not), once.
  static const std::string& reference() {
    static const std::string bytes = [] {
      Result r = ddp::testing::run_command(
          {.argv = concat({kDdprun, "--standalone", "--nproc-per-node", "2"}, mlp("ddprun")),
           .unset_env = {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"},
           .timeout_s = 180});
      EXPECT_TRUE(r.exited(0)) << r.describe();
      return bytes_of(*dir_ / "ddprun" / "model_state.pt");
    }();
    return bytes;
  }

  // A client command as a cluster user runs it: srun and sbatch pass the caller's environment
  // on, which sets no thread counts.
  static ddp::testing::Command client(std::vector<std::string> argv, double timeout_s) {
    ddp::testing::Command c = cluster_->client(std::move(argv), timeout_s);
    c.unset_env.push_back("OMP_NUM_THREADS");
    c.unset_env.push_back("OPENBLAS_NUM_THREADS");
    return c;
  }
  static Result srun(const std::vector<std::string>& args, double timeout_s = 180) {
    return ddp::testing::run_command(client(concat({kSrun}, args), timeout_s));
  }

  static inline SlurmCluster* cluster_ = nullptr;
  static inline fs::path* dir_ = nullptr;
  static inline std::string* skip_ = nullptr;
};

// srun -n 2 ddp-train: the ranks from SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID, the
// store on loopback (one node), the job id as run id; the same bytes as under ddprun.
TEST_F(Slurm, SrunStartsTheRanksAndTrainsTheSameBytesAsDdprun) {
  ASSERT_FALSE(reference().empty());
  Result r = srun(concat({"-n", "2"}, mlp("srun")));
  ASSERT_TRUE(r.exited(0)) << r.describe() << cluster_->logs();
  EXPECT_NE(r.out.find("2 ranks x 1 thread (LibTorch and BLAS)"), std::string::npos) << r.out;
  EXPECT_TRUE(bytes_of(*dir_ / "srun" / "model_state.pt") == reference())
      << "srun's run differs in bits from ddprun's";
}

// srun -n 1 ddprun --nproc-per-node 2: one ddprun per node starting the node's ranks, as
// torchrun users run it under Slurm.
TEST_F(Slurm, SrunStartsOneDdprunPerNode) {
  ASSERT_FALSE(reference().empty());
  Result r =
      srun(concat({"-n", "1", kDdprun, "--nproc-per-node", "2"}, mlp("srun_ddprun")));
  ASSERT_TRUE(r.exited(0)) << r.describe() << cluster_->logs();
  EXPECT_TRUE(bytes_of(*dir_ / "srun_ddprun" / "model_state.pt") == reference())
      << "srun ddprun's run differs in bits from ddprun's";
}

// sbatch --requeue: the job is preempted (scontrol requeue: Slurm sends SIGTERM to the step),
// ddp-train checkpoints on the signal with every rank, and the requeued job, started again by
// Slurm, resumes with --resume auto to the weights of a run that was never interrupted.
TEST_F(Slurm, ARequeuedJobResumesToTheSameWeightsAsAnUninterruptedRun) {
  auto cnn = [](const std::string& out) {
    return std::vector<std::string>{
        kTrain, "--model", "cnn", "--train-subset", "2048", "--test-subset", "200",
        "--batch-size", "32", "--epochs", "2", "--workers", "1", "--seed", "5", "--no-plots",
        "--checkpoint-every", "4", "--resume", "auto", "--output-dir", (*dir_ / out).string()};
  };
  Result whole = srun(concat({"-n", "2"}, cnn("whole")), 300);
  ASSERT_TRUE(whole.exited(0)) << whole.describe();

  const fs::path script = *dir_ / "job.sh";
  std::string line = "exec srun";
  for (const std::string& a : cnn("requeued")) line += " '" + a + "'";
  std::ofstream(script) << "#!/bin/sh\n" << line << "\n";
  const std::string log = (*dir_ / "job.out").string();
  Result submitted = ddp::testing::run_command(
      client({"/usr/bin/sbatch", "--parsable", "-n", "2", "--requeue", "--open-mode=append", "-o",
              log, script.string()},
             60));
  ASSERT_TRUE(submitted.exited(0)) << submitted.describe();
  const std::string job = submitted.out.substr(0, submitted.out.find_first_of(";\n"));

  const fs::path first = *dir_ / "requeued" / "checkpoints" / "epoch=0-step=4.ckpt";
  ASSERT_TRUE(ddp::testing::wait_until([&] { return fs::exists(first); }, 180))
      << bytes_of(log) << cluster_->logs();
  Result requeue = cluster_->run({"/usr/bin/scontrol", "requeue", job});
  ASSERT_TRUE(requeue.exited(0)) << requeue.describe();
  const auto requeued_at = std::chrono::steady_clock::now();
  // Slurm holds a requeued batch job for two minutes (its begin time) once its first run has
  // ended (PENDING again): release it then, as an operator would, to keep the test short.
  ASSERT_TRUE(ddp::testing::wait_until([&] { return cluster_->job_state(job) == "PENDING"; }, 60))
      << "job " << job << " is " << cluster_->job_state(job) << "\n" << bytes_of(log);
  const double stopped_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - requeued_at).count();
  Result release = cluster_->run({"/usr/bin/scontrol", "update", "jobid=" + job, "StartTime=now"});
  ASSERT_TRUE(release.exited(0)) << release.describe();
  ASSERT_TRUE(ddp::testing::wait_until(
      [&] { return cluster_->job_state(job) == "COMPLETED"; }, 420))
      << "job " << job << " is " << cluster_->job_state(job) << "\n"
      << bytes_of(log) << cluster_->logs();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - requeued_at).count();
  const std::string out = bytes_of(log);
  EXPECT_NE(out.find("preempted at step "), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
  Result info = cluster_->run({"/usr/bin/scontrol", "show", "job", job});
  EXPECT_NE(info.out.find("Restarts=1"), std::string::npos) << info.out;
  EXPECT_TRUE(bytes_of(*dir_ / "requeued" / "model_state.pt") ==
              bytes_of(*dir_ / "whole" / "model_state.pt"))
      << "the requeued job ended with other weights than the uninterrupted run\n" << out;
  std::printf("[ measured ] requeued job %s: its first run stopped (checkpoint written) %.1f s "
              "after scontrol requeue; the job done %.1f s after it\n",
              job.c_str(), stopped_s, seconds);
}

// Setups that cannot work end at once with one line naming the Slurm variable.
TEST_F(Slurm, SetupsThatCannotWorkGetOneLineNamingTheVariable) {
  {
    SCOPED_TRACE("two ddprun tasks on one node");
    Result r = srun(concat({"-n", "2", kDdprun, "--nproc-per-node", "1"}, mlp("bad1")), 60);
    EXPECT_FALSE(r.exited(0)) << r.describe();
    EXPECT_NE(r.err.find("ddprun: error: Slurm started 2 ddprun tasks on this node"),
              std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("srun --ntasks-per-node=1 ddprun"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(*dir_ / "bad1")) << "nothing may start";
  }
  {
    SCOPED_TRACE("--nnodes other than the step's nodes");
    Result r = srun(concat({"-n", "1", kDdprun, "--nnodes", "2", "--nproc-per-node", "1"},
                           mlp("bad2")), 60);
    EXPECT_TRUE(r.exited(2)) << r.describe();
    EXPECT_NE(r.err.find("but the Slurm step runs ddprun on 1 node(s) (SLURM_STEP_NUM_NODES=1)"),
              std::string::npos) << r.describe();
  }
  // A node list whose first name does not resolve. A one-node cluster has no second node: the
  // step's variables are those of a two-node step (as srun -N 2 sets them) but the node names
  // are unknown, which no retry can fix.
  const std::string two_nodes =
      "export SLURM_STEP_NUM_NODES=2 SLURM_STEP_TASKS_PER_NODE='1(x2)' SLURM_LOCALID=0 "
      "SLURM_NODEID=$SLURM_PROCID SLURM_STEP_NODELIST='nosuch-node[1-2]'; exec \"$@\"";
  {
    SCOPED_TRACE("srun ddp-train, unresolvable node list");
    Result r = srun(concat({"-n", "2", "/bin/sh", "-c", two_nodes, "sh"}, mlp("bad3")), 60);
    EXPECT_TRUE(r.exited(2)) << r.describe();
    EXPECT_NE(r.err.find("the rendezvous address 'nosuch-node1', the first node of "
                         "SLURM_STEP_NODELIST='nosuch-node[1-2]', does not resolve"),
              std::string::npos) << r.describe();
    EXPECT_LT(r.wall_s, 30) << "an unresolvable node list is final: no waiting for a timeout";
  }
  {
    SCOPED_TRACE("srun ddprun, unresolvable node list");
    Result r = srun(concat({"-n", "2", "/bin/sh", "-c", two_nodes, "sh", kDdprun, "--nnodes",
                            "2", "--nproc-per-node", "1"},
                           mlp("bad4")), 60);
    EXPECT_TRUE(r.exited(2)) << r.describe();
    EXPECT_NE(r.err.find("the store's host 'nosuch-node1', the first node of "
                         "SLURM_STEP_NODELIST='nosuch-node[1-2]', does not resolve"),
              std::string::npos) << r.describe();
    EXPECT_LT(r.wall_s, 30);
  }
}

}  // namespace
