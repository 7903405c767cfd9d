// The shared-memory transport between real processes: a SIGKILLed and a SIGSTOPped peer are
// named within seconds, nothing is left in /dev/shm after a kill, and two jobs on one host run
// side by side.
#include <dirent.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/ranks.h"  // free_port
#include "support/subprocess.h"

namespace ddp {
namespace {

using testing::Command;
using testing::Subprocess;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kAllreduce = testing::env_or_die("EXAMPLE_ALLREDUCE");
const std::string kHangWorker = testing::env_or_die("HANG_TEST_WORKER");

std::set<std::string> dev_shm() {
  std::set<std::string> out;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) out.insert(e->d_name);
    closedir(d);
  }
  return out;
}

bool maps_contain(int pid, const std::string& needle) {
  std::ifstream maps(fmt::format("/proc/{}/maps", pid));
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(needle) != std::string::npos) return true;
  }
  return false;
}

// Two ranks of example_allreduce started directly (no launcher to tear the survivor down), over
// shm; rank 1 joins the group and then never calls the all_reduce rank 0 waits in.
struct TwoRanks {
  Subprocess rank0, rank1;
};

// Rank `rank` of 2 running `argv` over shm, started by hand on `port` (collective timeout 120 s).
Command rank_of_two(std::vector<std::string> argv, int rank, int port) {
  return Command{.argv = std::move(argv),
                 .env = {{"RANK", std::to_string(rank)},
                         {"WORLD_SIZE", "2"},
                         {"LOCAL_RANK", std::to_string(rank)},
                         {"LOCAL_WORLD_SIZE", "2"},
                         {"MASTER_ADDR", "127.0.0.1"},
                         {"MASTER_PORT", std::to_string(port)},
                         {"DDP_BACKEND", "shm"},
                         {"DDP_COLLECTIVE_TIMEOUT", "120"}},
                 .timeout_s = 60};
}

TwoRanks start_pair() {
  const int port = testing::free_port();
  auto cmd = [&](int rank) { return rank_of_two({kAllreduce, "--hang-rank", "1"}, rank, port); };
  TwoRanks p{Subprocess::start(cmd(0)), Subprocess::start(cmd(1))};
  // Rank 0 prints once the group (and its shared segment) is formed.
  EXPECT_TRUE(
      testing::wait_until([&] { return p.rank0.out_so_far().find("via") != std::string::npos; },
                          30))
      << p.rank0.err_so_far();
  return p;
}

TEST(ShmMultiproc, KilledPeerIsNamedWithinSecondsAndNothingIsLeftInDevShm) {
  const auto before = dev_shm();
  TwoRanks p = start_pair();
  EXPECT_TRUE(maps_contain(p.rank0.pid(), "memfd:ddp-shm")) << "rank 0 does not map a segment";
  const int victim = p.rank1.pid();
  p.rank1.signal(SIGKILL);
  const double killed_at = p.rank0.elapsed_s();
  const auto& r = p.rank0.wait();
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s - killed_at, 5.0) << r.describe();
  for (const std::string& needle : {std::string("[rank 0] all_reduce #1 (sum, 4 x Float) failed"),
                                    fmt::format("rank 1 (pid {}) exited or was killed", victim)}) {
    EXPECT_NE(r.err.find(needle), std::string::npos) << needle << "\n" << r.describe();
  }
  p.rank1.wait();
  EXPECT_EQ(dev_shm(), before);
}

// A recv whose sender's process is killed before it sent fails within a second or so, naming
// the sender and its pid, not at the collective timeout (120 s here): Note [Point to point].
TEST(ShmMultiproc, ARecvWhoseSenderWasKilledFailsWithinSeconds) {
  const int port = testing::free_port();
  Subprocess rank0 = Subprocess::start(rank_of_two({kHangWorker, "recv"}, 0, port));
  Subprocess rank1 = Subprocess::start(rank_of_two({kHangWorker, "recv"}, 1, port));
  ASSERT_TRUE(testing::wait_until(
      [&] { return rank1.out_so_far().find("ready pid=") != std::string::npos; }, 30))
      << rank1.err_so_far();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0 is in its recv
  const int victim = rank1.pid();
  rank1.signal(SIGKILL);
  const double killed_at = rank0.elapsed_s();
  const auto& r = rank0.wait();
  rank1.wait();
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s - killed_at, 5.0) << r.describe();
  EXPECT_NE(r.err.find(fmt::format("[rank 0] recv #1 (from rank 1, tag 0, 4 x Float) failed: "
                                   "rank 1 (pid {}) exited or was killed before sending it",
                                   victim)),
            std::string::npos)
      << r.describe();
}

TEST(ShmMultiproc, StoppedPeerIsNamedWithinSeconds) {
  TwoRanks p = start_pair();
  const int victim = p.rank1.pid();
  p.rank1.signal(SIGSTOP);
  const double stopped_at = p.rank0.elapsed_s();
  const auto& r = p.rank0.wait();
  p.rank1.signal(SIGKILL);
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s - stopped_at, 8.0) << r.describe();
  EXPECT_NE(r.err.find(fmt::format("rank 1 (pid {}) is stopped", victim)), std::string::npos)
      << r.describe();
  EXPECT_NE(r.err.find(fmt::format("kill -CONT {}", victim)), std::string::npos) << r.describe();
}

TEST(ShmMultiproc, TwoJobsSideBySideOnOneHost) {
  // 3M floats: 12 MiB per rank, many chunks each, both jobs at once.
  auto job = [] {
    return Subprocess::start({.argv = {kDdprun, "--standalone", "--nproc-per-node", "2", kAllreduce,
                                       "--elements", "3000000"},
                              .env = {{"DDP_DEBUG", "info"}},
                              .timeout_s = 120});
  };
  Subprocess a = job(), b = job();
  for (Subprocess* s : {&a, &b}) {
    const auto& r = s->wait();
    EXPECT_TRUE(r.exited(0)) << r.describe();
    EXPECT_NE(r.out.find("[rank 1]: all_reduce(sum) of [1..2] over 2 ranks = 3 (expected 3): OK"),
              std::string::npos)
        << r.describe();
    EXPECT_NE(r.err.find("over shm"), std::string::npos) << r.describe();
  }
}

}  // namespace
}  // namespace ddp
