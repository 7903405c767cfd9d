// What init_process_group sets up for a program written as the README teaches (Note [Process
// defaults], src/runtime/process_defaults.cpp), as real processes: the rank's thread count
// reaches the BLAS whatever launched it (ddprun, or Slurm's and Open MPI's variables with no
// OMP_NUM_THREADS), so one seed trains to the same bytes under each; an error that escapes
// main() is printed once, recorded in the error file, and ends the process with exit code 1
// (no abort); a program's own terminate handler still wins.
#include <sched.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/blas.h"       // inspect_blas_apart
#include "support/ranks.h"  // free_port
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Command;
using testing::Result;
using testing::Subprocess;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kWorker = testing::env_or_die("WORKER");
const std::string kTrain = testing::env_or_die("DDP_TRAIN");

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

// Rank `rank` of 2 on this host, its launch variables those of `launcher` ("slurm", "mpi"),
// with no OMP_NUM_THREADS: what srun and mpirun give a process.
Command by_hand(const std::string& launcher, int rank, int port, std::vector<std::string> argv) {
  std::map<std::string, std::string> env = {{"MASTER_ADDR", "127.0.0.1"},
                                            {"MASTER_PORT", std::to_string(port)}};
  if (launcher == "slurm") {
    env.insert({{"SLURM_PROCID", std::to_string(rank)},
                {"SLURM_STEP_NUM_TASKS", "2"},
                {"SLURM_STEP_NUM_NODES", "1"},
                {"SLURM_LOCALID", std::to_string(rank)},
                {"SLURM_NODEID", "0"},
                {"SLURM_JOB_ID", std::to_string(port)},
                {"SLURM_STEP_NODELIST", "localhost"}});
  } else {
    env.insert({{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
                {"OMPI_COMM_WORLD_SIZE", "2"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank)},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  }
  return {.argv = std::move(argv),
          .env = env,
          .unset_env = {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY", "RANK",
                        "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_ERROR_FILE",
                        "OPENBLAS_THREAD_TIMEOUT"},
          .timeout_s = 120};
}

// Both ranks of `launcher` by hand; their results, rank 0 first.
std::vector<Result> run_pair(const std::string& launcher, const std::vector<std::string>& argv) {
  const int port = testing::free_port();
  Subprocess r0 = Subprocess::start(by_hand(launcher, 0, port, argv));
  Subprocess r1 = Subprocess::start(by_hand(launcher, 1, port, argv));
  return {r0.wait(), r1.wait()};
}

struct Threads {
  int torch = -1, blas = -1;
  std::string wait, timeout;
  int reexec = -1;
  std::string core;
};
Threads threads_of(const std::string& out) {
  std::smatch m;
  static const std::regex re(
      R"(threads (\d+) blas (-?\d+) wait (\S+) timeout (\S+) reexec (\d) core (\S+))");
  EXPECT_TRUE(std::regex_search(out, m, re)) << out;
  return m.empty() ? Threads{}
                   : Threads{std::stoi(m[1]), std::stoi(m[2]), m[3], m[4], std::stoi(m[5]), m[6]};
}

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(ProcessDefaults, ThreadsReachTheBlasWhateverLaunchedIt) {
  const int per_rank = std::max(1, usable_cpus() / 2);
  for (const std::string launcher : {"slurm", "mpi"}) {
    SCOPED_TRACE(launcher);
    for (const Result& r : run_pair(launcher, {kWorker, "threads"})) {
      ASSERT_TRUE(r.exited(0)) << r.describe();
      const Threads t = threads_of(r.out);
      EXPECT_EQ(t.torch, per_rank) << r.out;
      EXPECT_EQ(t.blas, per_rank) << "the BLAS did not get the rank's threads\n" << r.out;
    }
  }
  // ddprun exports OMP_NUM_THREADS=1 for several workers: LibTorch and the BLAS read it.
  Result r = testing::run_command({.argv = {kDdprun, "--standalone", "--nproc-per-node", "2",
                                            kWorker, "threads"},
                                   .unset_env = {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"},
                                   .timeout_s = 120});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  const size_t first = r.out.find("threads 1 blas 1");
  ASSERT_NE(first, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("threads 1 blas 1", first + 1), std::string::npos) << "one rank only\n"
                                                                          << r.out;
  // ddprun gave each worker the BLAS settings its ensure_fast_blas wants (here the CPU's best
  // OpenBLAS core, where OpenBLAS alone picks a weaker one): no worker started twice.
  const BlasReport blas = inspect_blas_apart();
  const Threads t = threads_of(r.out);
  EXPECT_EQ(t.reexec, 0) << r.out;
  if (blas.needs_core_override()) EXPECT_EQ(t.core, blas.cpu_best_core) << r.out;
  // The user's OMP_NUM_THREADS is the count, for both.
  r = testing::run_command({.argv = {kWorker, "threads"},
                            .env = {{"OMP_NUM_THREADS", "3"}},
                            .unset_env = {"OPENBLAS_NUM_THREADS", "RANK", "WORLD_SIZE",
                                          "OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT"},
                            .timeout_s = 60});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  const Threads three = threads_of(r.out);
  EXPECT_EQ(three.torch, 3);
  EXPECT_EQ(three.blas, 3);
  // Several threads beside OpenBLAS's own: ensure_fast_blas made the idle ones of both sleep.
  EXPECT_EQ(three.wait, "passive") << r.out;
  EXPECT_EQ(three.timeout, "4") << r.out;
  EXPECT_EQ(three.reexec, 1) << "no launcher to set them: it re-executed itself\n" << r.out;
}

TEST(ProcessDefaults, OneSeedTrainsToTheSameBytesUnderDdprunSlurmAndMpi) {
  const fs::path dir = testing::make_temp_dir("ddp_process_defaults");
  auto train = [&](const std::string& out) {
    return std::vector<std::string>{kTrain, "--model", "mlp", "--train-subset", "512",
                                    "--test-subset", "200", "--batch-size", "32", "--epochs", "1",
                                    "--workers", "1", "--seed", "3", "--output-dir",
                                    (dir / out).string()};
  };
  std::vector<std::string> launched = {kDdprun, "--standalone", "--nproc-per-node", "2"};
  const std::vector<std::string> ddprun_train = train("ddprun");
  launched.insert(launched.end(), ddprun_train.begin(), ddprun_train.end());
  Result r = testing::run_command({.argv = launched,
                                   .unset_env = {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"},
                                   .timeout_s = 180});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  const std::string reference = bytes_of(dir / "ddprun" / "model_state.pt");
  ASSERT_FALSE(reference.empty());
  for (const std::string launcher : {"slurm", "mpi"}) {
    SCOPED_TRACE(launcher);
    for (const Result& rank : run_pair(launcher, train(launcher))) {
      ASSERT_TRUE(rank.exited(0)) << rank.describe();
    }
    EXPECT_TRUE(bytes_of(dir / launcher / "model_state.pt") == reference)
        << "the weights differ from the same run under ddprun";
  }
  fs::remove_all(dir);
}

TEST(ProcessDefaults, AnUncaughtErrorIsPrintedOnceRecordedAndExitsOne) {
  const fs::path dir = testing::make_temp_dir("ddp_process_defaults");
  const int port = testing::free_port();
  Command rank0 = by_hand("mpi", 0, port, {kWorker, "uncaught"});
  rank0.env["TORCHELASTIC_ERROR_FILE"] = (dir / "error.json").string();
  rank0.unset_env.erase(std::remove(rank0.unset_env.begin(), rank0.unset_env.end(),
                                    "TORCHELASTIC_ERROR_FILE"),
                        rank0.unset_env.end());
  Subprocess p0 = Subprocess::start(rank0);
  Subprocess p1 = Subprocess::start(by_hand("mpi", 1, port, {kWorker, "uncaught"}));
  const Result r = p0.wait();
  p1.wait();
  EXPECT_TRUE(r.exited(1)) << r.describe();
  const std::string line = "[rank 0]: error: uncaught ddp::CollectiveError: ";
  ASSERT_NE(r.err.find(line), std::string::npos) << r.describe();
  EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.describe();
  // The collective's own message, once: its first line after the prefix.
  const size_t from = r.err.find(line) + line.size();
  const std::string what = r.err.substr(from, r.err.find('\n', from) - from);
  EXPECT_EQ(r.err.find(what), r.err.rfind(what)) << "printed twice\n" << r.describe();
  const std::string recorded = bytes_of(dir / "error.json");
  EXPECT_NE(recorded.find(what.substr(0, 40)), std::string::npos) << recorded;
  fs::remove_all(dir);
}

TEST(ProcessDefaults, DdprunNamesTheUncaughtErrorAndItsExitCode) {
  Result r = testing::run_command(
      {.argv = {kDdprun, "--standalone", "--nproc-per-node", "2", kWorker, "uncaught"},
       .timeout_s = 120});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_NE(r.err.find("exit      : exit code 1"), std::string::npos) << r.describe();
  EXPECT_EQ(r.err.find("SIGABRT"), std::string::npos) << r.describe();
  EXPECT_EQ(r.err.find("error file: (none)"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("error file: "), std::string::npos) << r.describe();
}

TEST(ProcessDefaults, TheProgramsOwnTerminateHandlerWins) {
  const int port = testing::free_port();
  Subprocess p0 = Subprocess::start(by_hand("mpi", 0, port, {kWorker, "own-handler"}));
  Subprocess p1 = Subprocess::start(by_hand("mpi", 1, port, {kWorker, "own-handler"}));
  const Result r = p0.wait();
  p1.wait();
  EXPECT_TRUE(r.exited(7)) << r.describe();
  EXPECT_NE(r.err.find("the program's own terminate handler"), std::string::npos) << r.describe();
  EXPECT_EQ(r.err.find("error: uncaught"), std::string::npos) << r.describe();
}

}  // namespace
}  // namespace ddp
