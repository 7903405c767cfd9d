// Faults injected into real jobs under ddprun: checkpoint writes that fail (a file-size limit,
// a read-only folder), a corrupt dataset, a rank that exits 0 while the others still reduce, a
// second job started into a run folder in use.
// Each must end the job with a clear error naming what failed, non-zero, within a bound, and
// leave the previous checkpoint intact. (ddprun's own faults, a SIGKILLed or SIGSTOPped worker,
// are in test_ddprun_launcher.)
#include <sys/stat.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/checkpoint.h"  // verify_checkpoint
#include "support/subprocess.h"
#include "support/temp_dir.h"

// Command lines and worker scripts are laid out by hand (a flag with its value, an action with
// its arguments), which clang-format would put one string per line.
// clang-format off
namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Command;
using testing::Result;
using testing::run_command;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kTrain = testing::env_or_die("DDP_TRAIN");
const std::string kEarlyExitWorker = testing::env_or_die("EARLY_EXIT_WORKER");
const fs::path kData = "/usr/share/datasets/fashion-mnist";
constexpr double kBound = 60;  // s: every faulty job must end well before this

// For the table of faults in docs/testing.md: how long the faulty job took, start to exit.
void measured(const std::string& what, const Result& r) {
  std::printf("[ measured ] %s: the job exited %d after %.2f s\n", what.c_str(), r.exit_code,
              r.wall_s);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ddp::testing::make_temp_dir("ddp_faults");
  }
  void TearDown() override { fs::remove_all(dir_); }

  // ddprun --standalone --nproc-per-node 2 ddp-train (a small MLP run) <extra>, its folder
  // dir_/run.
  Command train(std::vector<std::string> extra) {
    std::vector<std::string> argv = {kDdprun, "--standalone", "--nproc-per-node", "2", kTrain,
                                     "--model", "mlp", "--train-subset", "1536",
                                     "--test-subset", "1000", "--batch-size", "32",
                                     "--output-dir", (dir_ / "run").string(), "--workers", "1",
                                     "--no-plots", "--checkpoint-every", "10"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return {.argv = argv, .timeout_s = 240};
  }

  // A finished one-epoch run with checkpoints; returns last.ckpt's bytes.
  std::string first_run() {
    Result r = run_command(train({"--epochs", "1"}));
    EXPECT_TRUE(r.exited(0)) << r.describe();
    return read_bytes(checkpoints() / "last.ckpt");
  }

  // The run resumed for a second epoch: its first checkpoint write must fail.
  Command second_epoch() { return train({"--epochs", "2", "--resume", "auto"}); }

  // Nothing left behind, the newest checkpoint as it was and still valid.
  void expect_previous_checkpoint_intact(const std::string& before) {
    for (const auto& e : fs::directory_iterator(checkpoints())) {
      EXPECT_NE(e.path().filename().string()[0], '.') << "temporary left: " << e.path();
    }
    const fs::path last = checkpoints() / "last.ckpt";
    EXPECT_EQ(read_bytes(last), before) << "last.ckpt changed";
    EXPECT_NO_THROW(verify_checkpoint(last));
    EXPECT_FALSE(fs::exists(checkpoints() / "epoch=1-step=30.ckpt"));
  }

  fs::path checkpoints() const { return dir_ / "run" / "checkpoints"; }

  fs::path dir_;
};

// `ulimit -f` below a checkpoint's size: write() past the limit raises SIGXFSZ, which used to
// kill rank 0 silently. Now the write fails with EFBIG and says so; rank 1, told by rank 0,
// relays it, and the summary blames rank 0.
TEST_F(FaultTest, CheckpointPastTheFileSizeLimitFailsClearlyAndKeepsThePrevious) {
  const std::string before = first_run();
  ASSERT_FALSE(before.empty());
  const uint64_t limit = before.size() * 3 / 4;  // above the shared-memory segments' sizes
  Command c = second_epoch();
  c.argv.insert(c.argv.begin(), {"/usr/bin/prlimit", fmt::format("--fsize={}", limit)});
  Result r = run_command(c);
  measured("checkpoint past ulimit -f", r);
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, kBound) << r.describe();
  EXPECT_FALSE(contains(r.err, "SIGXFSZ")) << r.err;
  EXPECT_TRUE(contains(r.err, fmt::format("epoch=1-step=30.ckpt: checkpoint write failed: file "
                                          "too large: this process may write files of at most "
                                          "{} bytes (ulimit -f {})",
                                          limit, limit / 1024)))
      << r.err;
  EXPECT_TRUE(contains(r.err, "Root cause (earliest error file")) << r.err;
  EXPECT_TRUE(contains(r.err, "  rank      : 0 (local_rank 0) on host ")) << r.err;
  expect_previous_checkpoint_intact(before);
}

// A checkpoint folder this process may not write (root ignores permissions: the job runs as
// nobody): a clear error, the previous checkpoint intact.
TEST_F(FaultTest, ReadOnlyCheckpointFolderFailsClearlyAndKeepsThePrevious) {
  const std::string before = first_run();
  ASSERT_FALSE(before.empty());
  constexpr uid_t kNobody = 65534;
  fs::permissions(dir_, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec);
  for (const auto& e : fs::recursive_directory_iterator(dir_ / "run")) {
    ASSERT_EQ(::chown(e.path().c_str(), kNobody, kNobody), 0) << e.path();
  }
  ASSERT_EQ(::chown((dir_ / "run").c_str(), kNobody, kNobody), 0);
  fs::permissions(checkpoints(), fs::perms::owner_read | fs::perms::owner_exec |
                                     fs::perms::group_read | fs::perms::group_exec |
                                     fs::perms::others_read | fs::perms::others_exec);
  Command c = second_epoch();
  c.argv.insert(c.argv.begin(), {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534",
                                 "--clear-groups"});
  Result r = run_command(c);
  measured("read-only checkpoint folder", r);
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, kBound) << r.describe();
  EXPECT_TRUE(contains(r.err, "epoch=1-step=30.ckpt: cannot create the temporary file ")) << r.err;
  EXPECT_TRUE(contains(r.err, "(the checkpoint directory is not writable by this process; earlier "
                              "checkpoints in it are untouched): Permission denied"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "  rank      : 0 (local_rank 0) on host ")) << r.err;
  expect_previous_checkpoint_intact(before);
}

// A copy of the dataset with one file damaged: truncated, or one bit flipped inside the gzip
// stream. The job fails naming the file and what is wrong with it: each host's local rank 0
// reads the files whole and so checks them for every rank there (the others read their subset).
TEST_F(FaultTest, CorruptDatasetFileIsNamed) {
  struct Damage {
    const char* file;
    bool truncate;  // else flip a bit in the middle
    const char* says;
  };
  for (const Damage& d : {Damage{"train-images-idx3-ubyte.gz", true, "the file is truncated"},
                          Damage{"train-images-idx3-ubyte.gz", false, "the gzip stream is corrupt"},
                          Damage{"t10k-labels-idx1-ubyte.gz", false, "the gzip stream is corrupt"}}) {
    const fs::path data = dir_ / "data";
    fs::remove_all(data);
    fs::create_directories(data);
    for (const auto& e : fs::directory_iterator(kData)) {
      fs::copy_file(e.path(), data / e.path().filename());
    }
    const fs::path victim = data / d.file;
    const auto size = fs::file_size(victim);
    if (d.truncate) {
      fs::resize_file(victim, size / 4);
    } else {
      std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(size / 2));
      char c = 0;
      f.get(c);
      f.seekp(static_cast<std::streamoff>(size / 2));
      f.put(static_cast<char>(c ^ 0x10));
    }
    Result r = run_command(train({"--epochs", "1", "--data-dir", data.string()}));
    measured(fmt::format("{} {}", d.file, d.truncate ? "truncated" : "bit-flipped"), r);
    EXPECT_TRUE(r.exited(1)) << r.describe();
    EXPECT_LT(r.wall_s, kBound) << r.describe();
    EXPECT_TRUE(contains(r.err, "error file: " + victim.string() + ": ")) << d.file << r.err;
    EXPECT_TRUE(contains(r.err, d.says)) << d.file << "\n" << r.err;
  }
}

// A rank returns from main (exit code 0) while the others still all-reduce: they fail at
// once instead of waiting out the collective timeout (here 60 s), and the summary names the
// rank: ddprun's "Left early" line when it exited before the first failure, else the peers'
// errors (shm: "rank 1 destroyed its process group"; Gloo, whose peers see only "Connection
// closed by peer": the verdict from the records rank 1 published as it left, "rank 1 left the
// group").
TEST_F(FaultTest, RankExitingZeroEarlyFailsTheOthersNamingIt) {
  for (const char* backend : {"shm", "gloo"}) {
    Result r = run_command({.argv = {kDdprun, "--standalone", "--nproc-per-node", "3",
                                     kEarlyExitWorker, "40", "1"},
                            .env = {{"DDP_BACKEND", backend}, {"DDP_COLLECTIVE_TIMEOUT", "60"}},
                            .timeout_s = 120});
    measured(fmt::format("rank 1 of 3 exits 0 at step 20 of 40 ({})", backend), r);
    EXPECT_TRUE(r.exited(1)) << backend << "\n" << r.describe();
    EXPECT_LT(r.wall_s, 30.0) << backend << "\n" << r.describe();
    EXPECT_TRUE(contains(r.out, "[rank 1]: leaving after step 20 with exit code 0")) << r.out;
    EXPECT_FALSE(contains(r.out, "done")) << r.out;
    EXPECT_TRUE(contains(r.err, "ddprun: worker group failed (attempt 1 of 1)")) << r.err;
    EXPECT_TRUE(contains(r.err, "Left early: rank 1 exited with code 0 before any worker "
                                "failed, while the others still ran") ||
                contains(r.err, "rank 1 destroyed its process group (or is shutting down) "
                                "without reaching it") ||
                contains(r.err, "rank 1 left the group without issuing all_reduce #"))
        << backend << "\n" << r.err;
  }
}

// Two jobs started by mistake with one --output-dir (each --standalone: its own run id). The
// second is refused at once, naming the first; the first trains on, its folder holding only its
// own rows, checkpoints and history (Note [Run folder lease] in ddp/run_lease.h).
TEST_F(FaultTest, ASecondJobIntoTheSameFolderIsRefusedAtOnce) {
  testing::Subprocess first = testing::Subprocess::start(train({"--epochs", "200"}));
  const fs::path lease = dir_ / "run" / "run.lease";
  ASSERT_TRUE(testing::wait_until([&] { return fs::exists(checkpoints() / "last.ckpt"); }, 120))
      << first.err_so_far();
  const std::string held = read_bytes(lease);
  Result second = run_command(train({"--epochs", "1"}));
  measured("a second job into a run folder in use", second);
  EXPECT_TRUE(second.exited(1)) << second.describe();
  EXPECT_LT(second.wall_s, 20.0) << second.describe();
  EXPECT_TRUE(contains(second.err, "cannot take it: the folder is in use by another job: job '"))
      << second.err;
  EXPECT_TRUE(contains(second.err, "Give this job its own --output-dir, or stop the other job "
                                   "first"))
      << second.err;
  EXPECT_TRUE(contains(second.err, "  rank      : 0 (local_rank 0) on host ")) << second.err;
  EXPECT_FALSE(contains(second.out, "epoch 1")) << second.out;

  // The first job was not disturbed: it trains on and stops cleanly when asked.
  first.signal(SIGTERM);
  const Result& r = first.wait();
  EXPECT_EQ(r.term_signal, SIGTERM) << r.describe();  // ddprun ends by the signal it got
  EXPECT_TRUE(contains(r.out, "preempted at step ")) << r.describe();
  EXPECT_NO_THROW(verify_checkpoint(checkpoints() / "last.ckpt"));
  // One holder in the history: the first job's take and release, nothing of the second.
  const std::string log = read_bytes(dir_ / "run" / "run.lease.log");
  const auto lines = std::count(log.begin(), log.end(), '\n');
  EXPECT_EQ(lines, 2) << log;
  EXPECT_TRUE(contains(log, " take job '")) << log;
  EXPECT_TRUE(contains(log, " release job '")) << log;
  EXPECT_TRUE(contains(held, "\"round\":0")) << held;
  EXPECT_FALSE(fs::exists(lease)) << "released at the end";
  // Rows of one job only: steps never go back within a split.
  std::ifstream csv(dir_ / "run" / "metrics.csv");
  std::string line;
  std::getline(csv, line);
  int64_t last_train = -1;
  while (std::getline(csv, line)) {
    if (!contains(line, ",train,")) continue;
    const int64_t step = std::stoll(line);
    EXPECT_GT(step, last_train) << line;
    last_train = step;
  }
}

}  // namespace
}  // namespace ddp
// clang-format on
