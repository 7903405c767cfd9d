// ddprun as a real subprocess, driving launcher_test_worker (see its header for the actions).
//
// Every run has its own deadline (Command::timeout_s): a hang fails the test. Tests that kill
// things check afterwards, through the pids the workers wrote, that no process survived.
#include <netinet/in.h>  // sockaddr_in
#include <sched.h>       // sched_getaffinity
#include <signal.h>      // kill
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>  // close

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <gtest/gtest.h>

#include "base/net.h"  // pick_free_port
#include "support/subprocess.h"
#include "support/temp_dir.h"

extern char** environ;

// Command lines and worker scripts are laid out by hand (a flag with its value, an action with
// its arguments), which clang-format would put one string per line.
// clang-format off
namespace {

namespace fs = std::filesystem;
using ddp::testing::Command;
using ddp::testing::Result;
using ddp::testing::Subprocess;
using ddp::testing::wait_until;

constexpr double kDeadline = 30;  // s, for each ddprun run

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A binary's path: from the environment ctest sets, else guessed from DDP_BUILD_DIR.
std::string binary(const char* env_var, const char* relative) {
  if (const char* p = std::getenv(env_var); p != nullptr && *p != '\0') return p;
  const char* build = std::getenv("DDP_BUILD_DIR");
  return std::string(build != nullptr ? build : ".") + "/" + relative;
}

// The state letter of /proc/<pid>/stat ('R', 'S', 'T', 'Z'...); '?' when it cannot be read.
char process_state(pid_t pid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto paren = stat.rfind(')');  // "pid (comm) STATE ..."
  return paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : '?';
}

// True once `pid` is dead: gone, or a zombie waiting for a reaper that is not ddprun (after
// ddprun itself was killed, its workers are reparented to init, which may reap them late).
// Polls: a just-killed process may take a moment to go.
bool process_gone(pid_t pid) {
  auto dead = [pid] {
    if (::kill(pid, 0) == -1 && errno == ESRCH) return true;
    return process_state(pid) == 'Z';
  };
  return wait_until(dead, 3.0);
}

class DdprunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ddprun_ = binary("DDPRUN", "tools/ddprun/ddprun");
    worker_ = binary("TEST_WORKER", "tests/multiproc/launcher_test_worker");
    ASSERT_TRUE(fs::exists(ddprun_)) << ddprun_ << " not found; run through ctest";
    ASSERT_TRUE(fs::exists(worker_)) << worker_ << " not found; run through ctest";
    dir_ = ddp::testing::make_temp_dir("ddprun_test");
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // ddprun FLAGS... launcher_test_worker ACTIONS..., with a clean launcher environment (no
  // PET_* variables, no OMP_NUM_THREADS unless the test sets them) and TMPDIR in dir_.
  Command command(const std::vector<std::string>& flags, const std::vector<std::string>& actions,
                  double timeout_s = kDeadline) {
    Command cmd;
    cmd.argv = {ddprun_};
    cmd.argv.insert(cmd.argv.end(), flags.begin(), flags.end());
    cmd.argv.push_back(worker_);
    cmd.argv.insert(cmd.argv.end(), actions.begin(), actions.end());
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv = *e;
      if (kv.rfind("PET_", 0) == 0) cmd.unset_env.push_back(kv.substr(0, kv.find('=')));
    }
    cmd.unset_env.push_back("OMP_NUM_THREADS");
    cmd.env["TMPDIR"] = dir_.string();  // ddprun's run directory too, even if it is SIGKILLed
    cmd.timeout_s = timeout_s;
    return cmd;
  }

  Result run(const std::vector<std::string>& flags, const std::vector<std::string>& actions,
             double timeout_s = kDeadline) {
    return ddp::testing::run_command(command(flags, actions, timeout_s));
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  pid_t pid_from(const std::string& name) const { return std::stoi(read_file(dir_ / name)); }

  // Waits until every named file exists under dir_.
  bool files_appear(const std::vector<std::string>& names, double timeout_s = 20) const {
    return wait_until(
        [&] {
          for (const auto& n : names) {
            if (!fs::exists(dir_ / n)) return false;
          }
          return true;
        },
        timeout_s);
  }

  std::string ddprun_;
  std::string worker_;
  fs::path dir_;
};

const std::vector<std::string> kContractVars = {
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"};

std::vector<std::string> print_env_actions() {
  std::vector<std::string> a = {"echo", "hello", "print-env"};
  a.insert(a.end(), kContractVars.begin(), kContractVars.end());
  return a;
}

// --- output and environment

void expect_group_output(const Result& r, int nproc) {
  ASSERT_TRUE(r.exited(0)) << r.describe();
  for (int rank = 0; rank < nproc; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const std::string p = "[rank " + std::to_string(rank) + "]: ";
    const std::string n = std::to_string(nproc);
    for (const std::string& line : std::vector<std::string>{
             "hello", "LOCAL_RANK=" + std::to_string(rank), "RANK=" + std::to_string(rank),
          "GROUP_RANK=0", "ROLE_RANK=" + std::to_string(rank), "ROLE_NAME=default",
          "LOCAL_WORLD_SIZE=" + n, "WORLD_SIZE=" + n, "GROUP_WORLD_SIZE=1",
          "ROLE_WORLD_SIZE=" + n, "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29500",
          "TORCHELASTIC_RESTART_COUNT=0", "TORCHELASTIC_MAX_RESTARTS=0",
          "TORCHELASTIC_RUN_ID=none", "TORCHELASTIC_USE_AGENT_STORE=False",
          "TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "NCCL_ASYNC_ERROR_HANDLING=1",
          std::string("OMP_NUM_THREADS=") + (nproc > 1 ? "1" : "<unset>")}) {
      EXPECT_TRUE(contains(r.out, p + line + "\n")) << p + line << "\n" << r.describe();
    }
    std::regex error_file("\\[rank " + std::to_string(rank) +
                          "\\]: TORCHELASTIC_ERROR_FILE=/.+/attempt_0/" + std::to_string(rank) +
                          "/error.json\n");
    EXPECT_TRUE(std::regex_search(r.out, error_file)) << r.out;
  }
  // Every line carries a rank prefix, of a rank that exists.
  for (const std::string& line : lines_of(r.out)) {
    EXPECT_TRUE(std::regex_match(line, std::regex("\\[rank [0-9]+\\]: .*"))) << line;
  }
  EXPECT_FALSE(contains(r.out, "[rank " + std::to_string(nproc) + "]"));
}

TEST_F(DdprunTest, TwoWorkersPrefixedOutputAndEnvironment) {
  Result r = run({"--nproc-per-node", "2"}, print_env_actions());
  expect_group_output(r, 2);
  EXPECT_TRUE(contains(r.err, "OMP_NUM_THREADS=1")) << r.err;  // the note, with how to override
  EXPECT_TRUE(contains(r.err, "export OMP_NUM_THREADS")) << r.err;
}

TEST_F(DdprunTest, FourWorkersPrefixedOutputAndEnvironment) {
  expect_group_output(run({"--nproc_per_node", "4"}, print_env_actions()), 4);
}

TEST_F(DdprunTest, OneWorkerGetsNoOmpOverride) {
  Result r = run({}, print_env_actions());
  expect_group_output(r, 1);
  EXPECT_FALSE(contains(r.err, "OMP_NUM_THREADS")) << r.err;
}

// Note [Job secret]: a random secret per single-node job, the same for its workers; an
// inherited one passed through; none invented for one node of several.
TEST_F(DdprunTest, WorkersGetTheJobsStoreSecret) {
  auto secret_of = [](const std::string& out, int rank) {
    const std::string p = "[rank " + std::to_string(rank) + "]: DDP_STORE_SECRET=";
    const size_t at = out.find(p);
    if (at == std::string::npos) return std::string("(none)");
    return out.substr(at + p.size(), out.find('\n', at) - at - p.size());
  };
  Command cmd = command({"--nproc-per-node", "2"}, {"print-env", "DDP_STORE_SECRET"});
  cmd.unset_env.push_back("DDP_STORE_SECRET");
  Result first = ddp::testing::run_command(cmd);
  ASSERT_TRUE(first.exited(0)) << first.describe();
  const std::string secret = secret_of(first.out, 0);
  EXPECT_EQ(secret.size(), 64u) << first.out;
  EXPECT_EQ(secret.find_first_not_of("0123456789abcdef"), std::string::npos) << secret;
  EXPECT_EQ(secret_of(first.out, 1), secret);
  Result second = ddp::testing::run_command(cmd);
  ASSERT_TRUE(second.exited(0)) << second.describe();
  EXPECT_NE(secret_of(second.out, 0), secret) << "the same secret for two jobs";

  cmd.env["DDP_STORE_SECRET"] = "given-by-the-scheduler";
  Result inherited = ddp::testing::run_command(cmd);
  ASSERT_TRUE(inherited.exited(0)) << inherited.describe();
  EXPECT_EQ(secret_of(inherited.out, 1), "given-by-the-scheduler");

  const std::string port = std::to_string(ddp::net::pick_free_port());
  auto node = [&](int k) {
    Command c = command({"--nnodes", "2", "--node-rank", std::to_string(k), "--nproc-per-node", "1",
                         "--master-port", port},
                        {"print-env", "DDP_STORE_SECRET"});
    c.unset_env.push_back("DDP_STORE_SECRET");
    return c;
  };
  Subprocess node0 = Subprocess::start(node(0));
  Result multi = ddp::testing::run_command(node(1));
  ASSERT_TRUE(multi.exited(0)) << multi.describe();
  EXPECT_TRUE(node0.wait().exited(0)) << node0.wait().describe();
  EXPECT_EQ(secret_of(multi.out, 1), "<unset>") << multi.out;
}

TEST_F(DdprunTest, UserOmpNumThreadsIsKept) {
  Command cmd = command({"--nproc-per-node", "2"}, {"print-env", "OMP_NUM_THREADS"});
  cmd.env["OMP_NUM_THREADS"] = "3";
  Result r = ddp::testing::run_command(cmd);
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 1]: OMP_NUM_THREADS=3\n")) << r.out;
  EXPECT_FALSE(contains(r.err, "OMP_NUM_THREADS")) << r.err;
}

// Note [CPU binding]: --cpu-bind cores pins each worker to its own block of ddprun's CPUs and
// sets OMP_NUM_THREADS to its size; none leaves every worker on all of them.
TEST_F(DdprunTest, CpuBindCoresPinsEachWorkerToItsOwnCpus) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  ASSERT_EQ(::sched_getaffinity(0, sizeof mine, &mine), 0);
  std::vector<int> all;
  for (int i = 0; i < CPU_SETSIZE; ++i) {
    if (CPU_ISSET(i, &mine)) all.push_back(i);
  }
  const std::string every = fmt::format("{}", fmt::join(all, ","));
  auto cpus_of = [](const std::string& out, int rank) {
    const std::string p = "[rank " + std::to_string(rank) + "]: CPUS=";
    const size_t at = out.find(p);
    if (at == std::string::npos) return std::string("(none)");
    return out.substr(at + p.size(), out.find('\n', at) - at - p.size());
  };
  const int n = static_cast<int>(std::min<size_t>(all.size(), 4));
  Command cmd = command({"--nproc-per-node", std::to_string(n), "--cpu-bind", "cores"},
                        {"print-cpus", "print-env", "OMP_NUM_THREADS"});
  cmd.unset_env.push_back("OMP_NUM_THREADS");
  Result bound = ddp::testing::run_command(cmd);
  ASSERT_TRUE(bound.exited(0)) << bound.describe();
  EXPECT_TRUE(contains(bound.err, "--cpu-bind cores")) << bound.err;
  std::vector<int> seen;
  for (int rank = 0; rank < n; ++rank) {
    const std::string list = cpus_of(bound.out, rank);
    ASSERT_NE(list, "(none)") << bound.out;
    std::vector<int> ids;
    std::stringstream in(list);
    for (std::string id; std::getline(in, id, ',');) ids.push_back(std::stoi(id));
    EXPECT_FALSE(ids.empty());
    EXPECT_TRUE(contains(bound.out, fmt::format("[rank {}]: OMP_NUM_THREADS={}\n", rank,
                                                ids.size())))
        << bound.out;
    seen.insert(seen.end(), ids.begin(), ids.end());
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end())
      << "two workers share a CPU: " << bound.out;
  EXPECT_TRUE(std::includes(all.begin(), all.end(), seen.begin(), seen.end()))
      << "a CPU outside ddprun's mask: " << bound.out;

  cmd = command({"--nproc-per-node", std::to_string(n)}, {"print-cpus"});
  Result free = ddp::testing::run_command(cmd);
  ASSERT_TRUE(free.exited(0)) << free.describe();
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(cpus_of(free.out, rank), every) << free.out;
}

// Second node of two, three workers each: global ranks 3..5, prefixes follow them.
// Two nodes on this host: node 0's ddprun hosts the agent store on the master port, where every
// worker meets (Note [Restart rounds] in tools/ddprun/rounds.h).
TEST_F(DdprunTest, MultiNodeStaticEnvironment) {
  const std::string port = std::to_string(ddp::net::pick_free_port());
  auto node = [&](int k) {
    return command({"--nnodes", "2", "--node-rank", std::to_string(k), "--nproc-per-node", "3",
                    "--master-port", port, "--rdzv-id", "job42", "--collective-timeout", "5"},
                   {"print-env", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DDP_COLLECTIVE_TIMEOUT",
                    "TORCHELASTIC_USE_AGENT_STORE", "DDP_AGENT_STORE"});
  };
  Subprocess node0 = Subprocess::start(node(0));
  Result r = ddp::testing::run_command(node(1));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  ASSERT_TRUE(node0.wait().exited(0)) << node0.wait().describe();
  for (int lr = 0; lr < 3; ++lr) {
    const std::string p = "[rank " + std::to_string(3 + lr) + "]: ";
    for (const std::string& line : std::vector<std::string>{
             "RANK=" + std::to_string(3 + lr), "LOCAL_RANK=" + std::to_string(lr), "WORLD_SIZE=6",
             "GROUP_RANK=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port,
             "TORCHELASTIC_RUN_ID=job42", "DDP_COLLECTIVE_TIMEOUT=5",
             "TORCHELASTIC_USE_AGENT_STORE=True", "DDP_AGENT_STORE=ddp"}) {
      EXPECT_TRUE(contains(r.out, p + line + "\n")) << p + line << "\n" << r.out;
    }
  }
  EXPECT_TRUE(contains(node0.wait().out, "[rank 0]: GROUP_RANK=0\n")) << node0.wait().out;
}

TEST_F(DdprunTest, StandalonePicksAPortAndARunId) {
  Result r = run({"--standalone", "--nproc-per-node", "2"},
                 {"print-env", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("\\[rank 0\\]: MASTER_PORT=([0-9]+)\n")));
  int port = std::stoi(m[1]);
  EXPECT_GT(port, 0);
  EXPECT_NE(port, 29500);
  EXPECT_TRUE(contains(r.out, "[rank 1]: MASTER_PORT=" + m[1].str() + "\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 0]: MASTER_ADDR=127.0.0.1\n"));
  EXPECT_TRUE(std::regex_search(
      r.out, std::regex("TORCHELASTIC_RUN_ID=[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-")))
      << r.out;
}

// Two workers print 2000 lines each at once: every console line is whole, none mixed.
TEST_F(DdprunTest, LinesNeverInterleaveAndPartialLastLineIsFlushed) {
  const std::string text(200, 'x');
  Result r = run({"--nproc-per-node", "2"}, {"lines", "2000", text, "echo-partial", "no-newline"});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  std::regex line_re("\\[rank ([01])\\]: (" + text + " ([0-9]+)|no-newline)");
  int counts[2] = {0, 0};
  for (const std::string& line : lines_of(r.out)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, line_re)) << "mangled line: " << line.substr(0, 300);
    if (m[3].matched) ++counts[std::stoi(m[1])];
  }
  EXPECT_EQ(counts[0], 2000);
  EXPECT_EQ(counts[1], 2000);
  EXPECT_TRUE(contains(r.out, "[rank 0]: no-newline\n"));
  EXPECT_TRUE(contains(r.out, "[rank 1]: no-newline\n"));
}

TEST_F(DdprunTest, StderrGoesToStderr) {
  Result r = run({"--nproc-per-node", "2"}, {"stderr", "to-stderr", "echo", "to-stdout"});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_TRUE(contains(r.err, "[rank 1]: to-stderr\n")) << r.err;
  EXPECT_FALSE(contains(r.out, "to-stderr")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1]: to-stdout\n")) << r.out;
}

// --- failures

TEST_F(DdprunTest, SigkilledWorkerStopsTheGroupAndIsReported) {
  const std::string d = dir_.string();
  Result r = run({"--nproc-per-node", "2"},
                 {"touch-pidfile", d, "only-rank", "1", "wait-file", path("0.pid"), "kill-self",
                  "SIGKILL", "end", "sleep", "60"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "worker group failed (attempt 1 of 1)")) << r.err;
  EXPECT_TRUE(contains(r.err, "Root cause (first observed failure)")) << r.err;
  EXPECT_TRUE(contains(r.err, "rank      : 1 (local_rank 1) on host ")) << r.err;
  EXPECT_TRUE(contains(r.err, "exit      : SIGKILL (signal 9)")) << r.err;
  EXPECT_TRUE(contains(r.err, "pid       : " + std::to_string(pid_from("1.pid")))) << r.err;
  EXPECT_TRUE(contains(r.err, "Other workers: rank 0 stopped by ddprun (SIGTERM)")) << r.err;
  EXPECT_TRUE(process_gone(pid_from("0.pid")));
  EXPECT_TRUE(process_gone(pid_from("1.pid")));
}

TEST_F(DdprunTest, ExitCodeAndLastStderrLinesAreReported) {
  Result r = run({"--nproc-per-node", "3"},
                 {"only-rank", "2", "stderr", "warming up", "stderr", "ValueError: lr must be > 0",
                  "exit", "3", "end", "sleep", "60"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "rank      : 2 (local_rank 2)")) << r.err;
  EXPECT_TRUE(contains(r.err, "exit      : exit code 3")) << r.err;
  EXPECT_TRUE(contains(r.err, "error file: (none)")) << r.err;
  EXPECT_TRUE(contains(r.err, "last stderr lines of rank 2:\n    warming up\n    ValueError: lr "
                              "must be > 0\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "Other workers: ranks 0-1 stopped by ddprun (SIGTERM)")) << r.err;
}

TEST_F(DdprunTest, ErrorFileMessageIsReported) {
  Result r = run({"--nproc-per-node", "2"},
                 {"only-rank", "0", "write-error-file", "RuntimeError: CUDA out of memory", "exit",
                  "1", "end", "sleep", "60"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_TRUE(contains(r.err, "error file: RuntimeError: CUDA out of memory\n")) << r.err;
}

// Note [Root cause]: rank 1 records its error first but is slow to exit (it ignores SIGTERM and
// exits only once ddprun has reaped rank 0); rank 0 sees rank 1's error, records "Connection
// closed by peer" after it and exits at once. ddprun observes rank 0's failure first, yet the
// summary must blame rank 1 and still list rank 0's failure.
TEST_F(DdprunTest, RootCauseIsTheEarliestErrorFileNotTheFirstExit) {
  Result r = run({"--nproc-per-node", "2"},
                 {"touch-pidfile", dir_.string(),
                  "only-rank", "1", "ignore-sigterm", "record-error", "ValueError: lr must be > 0",
                  "touch", path("rank1-recorded"), "wait-reaped", path("0.pid"), "stderr",
                  "rank 1 exits late", "exit", "1", "end",
                  "only-rank", "0", "wait-file", path("rank1-recorded"), "record-error",
                  "RuntimeError: Connection closed by peer", "exit", "1", "end"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  // ddprun saw rank 0 fail first and stopped the group because of it (rank 1 exits as soon as
  // rank 0 is reaped, so the same round of reaping may already have seen it: 0 or 1 running)...
  EXPECT_TRUE(contains(r.err, "ddprun: rank 0 failed (exit code 1); stopping the other ")) << r.err;
  // ... but rank 1's error was recorded first.
  EXPECT_TRUE(contains(r.err, "Root cause (earliest error file):\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "  rank      : 1 (local_rank 1) on host ")) << r.err;
  EXPECT_TRUE(contains(r.err, "  pid       : " + std::to_string(pid_from("1.pid")) + "\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "  exit      : exit code 1\n"
                              "  error file: ValueError: lr must be > 0\n"
                              "  last stderr lines of rank 1:\n"
                              "    rank 1 exits late\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "Other workers: rank 0 also failed (exit code 1)\n"
                              "  error file of rank 0: RuntimeError: Connection closed by peer\n"))
      << r.err;
}

// The same race, but rank 1 is still tearing down when ddprun's SIGTERM kills it: having written
// an error file, it failed (it was not merely stopped), and it failed first.
TEST_F(DdprunTest, WorkerKilledByTheStopAfterRecordingItsErrorIsTheRootCause) {
  Result r = run({"--nproc-per-node", "3"},
                 {"only-rank", "1", "record-error", "ValueError: lr must be > 0", "touch",
                  path("rank1-recorded"), "sleep", "60", "end",
                  "only-rank", "0", "wait-file", path("rank1-recorded"), "record-error",
                  "RuntimeError: Connection closed by peer", "exit", "1", "end",
                  "only-rank", "2", "sleep", "60", "end"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "ddprun: rank 0 failed (exit code 1)")) << r.err;
  EXPECT_TRUE(contains(r.err, "Root cause (earliest error file):\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "  rank      : 1 (local_rank 1) on host ")) << r.err;
  EXPECT_TRUE(contains(r.err, "  exit      : SIGTERM (signal 15)\n"
                              "  error file: ValueError: lr must be > 0\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "Other workers: rank 0 also failed (exit code 1); rank 2 stopped by "
                              "ddprun (SIGTERM)\n"
                              "  error file of rank 0: RuntimeError: Connection closed by peer\n"))
      << r.err;
}

// Rank 0 fails (it cannot write a checkpoint) and tells its peers; rank 1 relays that and
// records its error first, rank 0 records its own only afterwards. The relayed record names its
// origin (extraInfo.relayed_from), so the summary blames rank 0 whatever the order.
TEST_F(DdprunTest, RelayedErrorRecordedFirstBlamesTheRankItCameFrom) {
  Result r = run({"--nproc-per-node", "3"},
                 // Rank 1 relays only once rank 0 ignores SIGTERM and has written its pid:
                 // otherwise ddprun's teardown could end rank 0 before either.
                 {"only-rank", "1", "wait-file", path("0.pid"), "record-relayed-error", "0",
                  "[rank 1] checkpoint save: rank 0 failed to write c.ckpt (its error says why)",
                  "touch", path("relayed"), "exit", "1", "end",
                  "only-rank", "0", "ignore-sigterm", "touch-pidfile", dir_.string(),
                  "wait-file", path("relayed"), "sleep",
                  "0.05", "record-error", "c.ckpt: cannot write the checkpoint: File too large",
                  "exit", "1", "end",
                  "only-rank", "2", "sleep", "60", "end"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "Root cause (earliest error file, relayed by rank 1):\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "  rank      : 0 (local_rank 0) on host ")) << r.err;
  EXPECT_TRUE(contains(r.err, "  pid       : " + std::to_string(pid_from("0.pid")) + "\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "  exit      : exit code 1\n"
                              "  error file: c.ckpt: cannot write the checkpoint: File too large\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "Other workers: rank 1 also failed (exit code 1); rank 2 stopped by "
                              "ddprun (SIGTERM)\n"
                              "  error file of rank 1 (relayed from rank 0): [rank 1] checkpoint "
                              "save: rank 0 failed to write c.ckpt (its error says why)\n"))
      << r.err;
}

// The same, but ddprun's SIGTERM ends rank 0 before it records anything: the relay still names
// it, and the summary blames it rather than its messenger.
TEST_F(DdprunTest, RelayedErrorBlamesItsOriginEvenWithoutTheOriginsRecord) {
  Result r = run({"--nproc-per-node", "2"},
                 {"only-rank", "1", "record-relayed-error", "0",
                  "[rank 1] checkpoint save: rank 0 failed to write c.ckpt (its error says why)",
                  "exit", "1", "end", "only-rank", "0", "sleep", "60", "end"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "Root cause (earliest error file, relayed by rank 1):\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "  rank      : 0 (local_rank 0) on host ")) << r.err;
  EXPECT_TRUE(contains(r.err, "  exit      : SIGTERM (signal 15)\n  error file: (none)\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "Other workers: rank 1 also failed (exit code 1)\n"
                              "  error file of rank 1 (relayed from rank 0): ")) << r.err;
}

// A frozen worker (SIGSTOP) acts on no SIGTERM: ddprun follows its SIGTERM with SIGCONT, so the
// teardown takes no grace period, and the summary says the worker was stopped.
TEST_F(DdprunTest, StoppedWorkerIsResumedAndEndedWithoutWaitingTheGracePeriod) {
  Result r = run({"--nproc-per-node", "3", "--grace-period", "60"},
                 {"touch-pidfile", dir_.string(),
                  "only-rank", "1", "stop-self", "sleep", "60", "end",
                  "only-rank", "2", "sleep", "60", "end",
                  "only-rank", "0", "wait-file", path("2.pid"), "wait-stopped", path("1.pid"),
                  "stderr",
                  "rank 1 stopped responding", "exit", "1", "end"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 5.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "  rank      : 0 (local_rank 0) on host ")) << r.err;
  EXPECT_TRUE(contains(r.err, "Other workers: rank 1 was stopped (process state T: SIGSTOP or a "
                              "debugger); ddprun resumed it: stopped by ddprun (SIGTERM); rank 2 "
                              "stopped by ddprun (SIGTERM)\n"))
      << r.err;
  for (const char* f : {"0.pid", "1.pid", "2.pid"}) EXPECT_TRUE(process_gone(pid_from(f))) << f;
}

// ddprun itself interrupted while a worker is frozen: the forwarded SIGTERM reaches it too.
TEST_F(DdprunTest, SigtermToDdprunEndsAStoppedWorkerAtOnce) {
  const std::string d = dir_.string();
  Subprocess p = Subprocess::start(command(
      {"--nproc-per-node", "2", "--grace-period", "60"},
      {"touch-pidfile", d, "only-rank", "1", "stop-self", "end", "sleep", "60"}));
  ASSERT_TRUE(files_appear({"0.pid", "1.pid"})) << p.err_so_far();
  const pid_t frozen = pid_from("1.pid");
  ASSERT_TRUE(wait_until([&] { return process_state(frozen) == 'T'; }, 20)) << p.err_so_far();
  const auto start = std::chrono::steady_clock::now();
  p.signal(SIGTERM);
  const Result& r = p.wait();
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_LT(took, 5.0) << r.describe();
  EXPECT_TRUE(r.term_signal == SIGTERM || r.exited(128 + SIGTERM)) << r.describe();
  EXPECT_TRUE(process_gone(pid_from("0.pid")));
  EXPECT_TRUE(process_gone(pid_from("1.pid")));
}

TEST_F(DdprunTest, WorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  Result r = run({"--nproc-per-node", "2", "--grace-period", "1"},
                 {"touch-pidfile", dir_.string(), "only-rank", "1", "ignore-sigterm", "touch",
                  path("ready"), "sleep", "60", "end", "only-rank", "0", "wait-file",
                  path("ready"), "exit", "1", "end"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_GE(r.wall_s, 1.0) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "rank 1 killed by ddprun (SIGKILL after the 1s grace period)"))
      << r.err;
  EXPECT_TRUE(process_gone(pid_from("1.pid")));
}

TEST_F(DdprunTest, ExecFailureInTheChildIsReported) {
  // Exists and is executable but is no program: execve fails with ENOEXEC in the child.
  const std::string bogus = path("not-a-program");
  { std::ofstream(bogus) << "this is not an executable\n"; }
  fs::permissions(bogus, fs::perms::owner_all);
  Command cmd = command({"--nproc-per-node", "2"}, {});
  cmd.argv = {ddprun_, "--nproc-per-node", "2", bogus};
  Result r = ddp::testing::run_command(cmd);
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_TRUE(contains(r.err, "ddprun: cannot execute '" + bogus + "': Exec format error"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "exit code 126")) << r.err;
}

// --- signals and leftovers

TEST_F(DdprunTest, SigtermIsForwardedAndNothingSurvives) {
  const std::string d = dir_.string();
  Subprocess p = Subprocess::start(
      command({"--nproc-per-node", "2"}, {"touch-pidfile", d, "spawn-sleeper", d, "sleep", "60"}));
  ASSERT_TRUE(files_appear({"0.pid", "1.pid", "0.child.pid", "1.child.pid"}))
      << p.err_so_far();
  p.signal(SIGTERM);
  const Result& r = p.wait();
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_TRUE(r.term_signal == SIGTERM || r.exited(128 + SIGTERM)) << r.describe();
  EXPECT_TRUE(contains(r.err, "received SIGTERM")) << r.err;
  for (const char* f : {"0.pid", "1.pid", "0.child.pid", "1.child.pid"}) {
    EXPECT_TRUE(process_gone(pid_from(f))) << f;
  }
}

// ddprun SIGKILLed: nothing can be forwarded, PR_SET_PDEATHSIG takes the workers down.
TEST_F(DdprunTest, WorkersDieWithASigkilledDdprun) {
  const std::string d = dir_.string();
  Subprocess p = Subprocess::start(
      command({"--nproc-per-node", "2"}, {"touch-pidfile", d, "sleep", "60"}));
  ASSERT_TRUE(files_appear({"0.pid", "1.pid"})) << p.err_so_far();
  p.signal(SIGKILL);
  EXPECT_EQ(p.wait().term_signal, SIGKILL) << p.wait().describe();
  EXPECT_TRUE(process_gone(pid_from("0.pid")));
  EXPECT_TRUE(process_gone(pid_from("1.pid")));
}

TEST_F(DdprunTest, LeftoverChildrenOfSuccessfulWorkersAreStopped) {
  const std::string d = dir_.string();
  Result r = run({"--nproc-per-node", "2", "--grace-period", "2"},
                 {"spawn-sleeper", d, "echo", "done"});
  EXPECT_TRUE(r.exited(0)) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  EXPECT_TRUE(process_gone(pid_from("0.child.pid")));
  EXPECT_TRUE(process_gone(pid_from("1.child.pid")));
}

// --- log files

std::vector<fs::path> find_files(const fs::path& root, const std::string& name) {
  std::vector<fs::path> found;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (e.path().filename() == name) found.push_back(e.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

TEST_F(DdprunTest, RedirectsWriteFilesAndKeepTheConsoleClean) {
  const fs::path logs = dir_ / "logs";
  Result r = run({"--nproc-per-node", "2", "--log-dir", logs.string(), "--redirects", "3",
                  "--rdzv-id", "myjob"},
                 {"echo", "to-stdout", "stderr", "to-stderr"});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_FALSE(contains(r.out, "to-stdout")) << r.out;
  EXPECT_FALSE(contains(r.err, "to-stderr")) << r.err;
  EXPECT_TRUE(contains(r.err, "worker logs: " + logs.string() + "/myjob_")) << r.err;
  auto outs = find_files(logs, "stdout.log");
  auto errs = find_files(logs, "stderr.log");
  ASSERT_EQ(outs.size(), 2u);
  ASSERT_EQ(errs.size(), 2u);
  for (int lr = 0; lr < 2; ++lr) {
    EXPECT_TRUE(std::regex_match(outs[lr].string(),
                                 std::regex(logs.string() + "/myjob_[^/]+/attempt_0/" +
                                            std::to_string(lr) + "/stdout.log")))
        << outs[lr];
    EXPECT_EQ(read_file(outs[lr]), "to-stdout\n");
    EXPECT_EQ(read_file(errs[lr]), "to-stderr\n");
  }
}

TEST_F(DdprunTest, TeeShowsAndWrites) {
  const fs::path logs = dir_ / "logs";
  Result r = run({"--nproc-per-node", "2", "--log-dir", logs.string(), "--tee", "3"},
                 {"echo", "to-stdout", "stderr", "to-stderr"});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 0]: to-stdout\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1]: to-stdout\n")) << r.out;
  EXPECT_TRUE(contains(r.err, "[rank 1]: to-stderr\n")) << r.err;
  auto outs = find_files(logs, "stdout.log");
  ASSERT_EQ(outs.size(), 2u);
  EXPECT_EQ(read_file(outs[1]), "to-stdout\n");
}

TEST_F(DdprunTest, RedirectsWithoutLogDirUseATemporaryDirectory) {
  Command cmd = command({"--nproc-per-node", "1", "-r", "1"}, {"echo", "hidden"});
  Result r = ddp::testing::run_command(cmd);
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_FALSE(contains(r.out, "hidden"));
  EXPECT_TRUE(contains(r.err, "worker logs: " + dir_.string() + "/ddprun_none_")) << r.err;
  auto outs = find_files(dir_, "stdout.log");
  ASSERT_EQ(outs.size(), 1u);
  EXPECT_EQ(read_file(outs[0]), "hidden\n");
}

TEST_F(DdprunTest, LocalRanksFilterShowsOnlyThoseRanks) {
  Result r = run({"--nproc-per-node", "2", "--local-ranks-filter", "0"},
                 {"echo", "hello", "stderr", "err-hello"});
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 0]: hello\n")) << r.out;
  EXPECT_FALSE(contains(r.out, "[rank 1]")) << r.out;
  EXPECT_TRUE(contains(r.err, "[rank 0]: err-hello\n")) << r.err;
  EXPECT_FALSE(contains(r.err, "[rank 1]")) << r.err;
}

// --- restarts

TEST_F(DdprunTest, RestartAfterAFailureThenSuccess) {
  Result r = run({"--nproc-per-node", "2", "--max-restarts", "1"},
                 {"only-rank", "1", "fail-once", path("failed-once"), "end", "print-env",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"});
  EXPECT_TRUE(r.exited(0)) << r.describe();
  EXPECT_TRUE(contains(r.err, "worker group failed (attempt 1 of 2)")) << r.err;
  EXPECT_TRUE(contains(r.err, "restarting")) << r.err;
  EXPECT_FALSE(contains(r.err, "Root cause")) << r.err;  // the summary is for the last attempt
  EXPECT_TRUE(contains(r.out, "[rank 0]: TORCHELASTIC_RESTART_COUNT=1\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1]: TORCHELASTIC_RESTART_COUNT=1\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1]: TORCHELASTIC_MAX_RESTARTS=1\n")) << r.out;
}

TEST_F(DdprunTest, RestartsExhausted) {
  Result r = run({"--nproc-per-node", "2", "--max-restarts", "2"},
                 {"only-rank", "0", "stderr", "always broken", "exit", "5", "end", "sleep", "60"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 20.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "(attempt 1 of 3)")) << r.err;
  EXPECT_TRUE(contains(r.err, "(attempt 2 of 3)")) << r.err;
  EXPECT_TRUE(contains(r.err, "ddprun: worker group failed (attempt 3 of 3)\nRoot cause")) << r.err;
  EXPECT_TRUE(contains(r.err, "exit      : exit code 5")) << r.err;
  // The last summary lists every attempt's root cause.
  EXPECT_TRUE(contains(r.err, "Earlier attempts:\n  attempt 1: rank 0 (local_rank 0) exit code 5\n"
                              "  attempt 2: rank 0 (local_rank 0) exit code 5\n"))
      << r.err;
}

// Note [Final failures]: exit code 2 (a usage or configuration error) is not restarted.
TEST_F(DdprunTest, RestartsSkipAUsageError) {
  Result r = run({"--nproc-per-node", "2", "--max-restarts", "3"},
                 {"only-rank", "1", "stderr", "bad flag", "exit", "2", "end", "sleep", "30"});
  EXPECT_TRUE(r.exited(1)) << r.describe();
  EXPECT_LT(r.wall_s, 10.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "not restarting (3 restart(s) left): rank 1 failed (exit code 2); "
                              "exit code 2 means a usage or configuration error"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "ddprun: worker group failed (attempt 1 of 4)\nRoot cause")) << r.err;
  EXPECT_FALSE(contains(r.err, "restarting it")) << r.err;
}

// Several nodes restart together (Note [Restart rounds]): a worker failing on node 1 stops node
// 0's workers at once (they would wait 30 s), and both nodes run round 1.
TEST_F(DdprunTest, RestartNodesTogetherAfterAFailureOnOne) {
  const std::string port = std::to_string(ddp::net::pick_free_port());
  auto node = [&](int k) {
    return command({"--nnodes", "2", "--node-rank", std::to_string(k), "--nproc-per-node", "2",
                    "--master-port", port, "--max-restarts", "1", "--grace-period", "2"},
                   // rank 3 fails once node 0's workers run (it joins a round within 0.1 s)
                   {"only-rank", "3", "sleep", "1", "fail-once", path("failed-once"), "touch", path("round-1"), "end",
                    "wait-file", path("round-1"),
                    "print-env", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"});
  };
  Subprocess node0 = Subprocess::start(node(0));
  Result r1 = ddp::testing::run_command(node(1));
  const Result& r0 = node0.wait();
  ASSERT_TRUE(r0.exited(0)) << r0.describe();
  ASSERT_TRUE(r1.exited(0)) << r1.describe();
  EXPECT_LT(r0.wall_s, 20.0) << "node 0's workers waited out their wait-file\n" << r0.describe();
  EXPECT_TRUE(contains(r0.err, "another node failed (node 1 (")) << r0.err;
  EXPECT_TRUE(contains(r0.err, "rank 3 failed (exit code 1)")) << r0.err;
  EXPECT_TRUE(contains(r0.err, "worker group failed (attempt 1 of 2): another node failed first"))
      << r0.err;
  EXPECT_TRUE(contains(r1.err, "worker group failed (attempt 1 of 2): rank 3")) << r1.err;
  for (const auto& [r, rank] : {std::pair{&r0, 0}, {&r0, 1}, {&r1, 2}, {&r1, 3}}) {
    const std::string p = "[rank " + std::to_string(rank) + "]: ";
    EXPECT_TRUE(contains(r->out, p + "TORCHELASTIC_RESTART_COUNT=1\n")) << r->out;
    EXPECT_TRUE(contains(r->out, p + "TORCHELASTIC_USE_AGENT_STORE=True\n")) << r->out;
  }
}

// A node's ddprun killed with its workers and started again (as a scheduler would) rejoins: the
// round it had joined ends on every node, and all meet in the next one.
TEST_F(DdprunTest, AKilledNodeStartedAgainRejoinsTheJob) {
  const std::string port = std::to_string(ddp::net::pick_free_port());
  const std::string d = dir_.string();
  auto node = [&](int k) {
    return command({"--nnodes", "2", "--node-rank", std::to_string(k), "--nproc-per-node", "1",
                    "--master-port", port, "--max-restarts", "2", "--grace-period", "2"},
                   {"touch-pidfile", d, "wait-file", path("go"),
                    "print-env", "TORCHELASTIC_RESTART_COUNT"}, 60);
  };
  Subprocess node0 = Subprocess::start(node(0));
  std::optional<Subprocess> node1;
  node1.emplace(Subprocess::start(node(1)));
  ASSERT_TRUE(files_appear({"0.pid", "1.pid"})) << node0.err_so_far() << node1->err_so_far();
  const pid_t old_worker = pid_from("1.pid");
  node1->signal(SIGKILL);  // its worker dies with it (PR_SET_PDEATHSIG)
  EXPECT_EQ(node1->wait().term_signal, SIGKILL);
  EXPECT_TRUE(process_gone(old_worker));
  node1.emplace(Subprocess::start(node(1)));
  ASSERT_TRUE(wait_until([&] { return contains(node0.err_so_far(), "restarting it"); }, 20))
      << node0.err_so_far() << node1->err_so_far();
  std::ofstream(dir_ / "go").put('\n');
  const Result& r0 = node0.wait();
  const Result& r1 = node1->wait();
  ASSERT_TRUE(r0.exited(0)) << r0.describe();
  ASSERT_TRUE(r1.exited(0)) << r1.describe();
  EXPECT_TRUE(contains(r0.err, "its ddprun started again")) << r0.err;
  EXPECT_TRUE(contains(r1.err, "previous ddprun took part in restart round 0")) << r1.err;
  EXPECT_TRUE(contains(r0.out, "[rank 0]: TORCHELASTIC_RESTART_COUNT=1\n")) << r0.out;
  EXPECT_TRUE(contains(r1.out, "[rank 1]: TORCHELASTIC_RESTART_COUNT=1\n")) << r1.out;
}

// Two ddprun given the same --node-rank: the second is refused (the first keeps answering in the
// agent store), and the job of the first goes on.
TEST_F(DdprunTest, ASecondDdprunWithTheSameNodeRankIsRefused) {
  const std::string port = std::to_string(ddp::net::pick_free_port());
  const std::string d = dir_.string();
  auto node = [&](int k) {
    return command({"--nnodes", "2", "--node-rank", std::to_string(k), "--nproc-per-node", "1",
                    "--master-port", port},
                   {"touch-pidfile", d, "wait-file", path("go")}, 60);
  };
  Subprocess node0 = Subprocess::start(node(0));
  Subprocess node1 = Subprocess::start(node(1));
  ASSERT_TRUE(files_appear({"0.pid", "1.pid"})) << node0.err_so_far() << node1.err_so_far();
  Result dup = ddp::testing::run_command(node(1));
  EXPECT_TRUE(dup.exited(1)) << dup.describe();
  EXPECT_LT(dup.wall_s, 10.0) << dup.describe();
  EXPECT_TRUE(contains(dup.err, "two ddprun were given --node-rank 1")) << dup.err;
  std::ofstream(dir_ / "go").put('\n');
  EXPECT_TRUE(node0.wait().exited(0)) << node0.wait().describe();
  EXPECT_TRUE(node1.wait().exited(0)) << node1.wait().describe();
}

// PROGRAM.py runs as "python3 -u PROGRAM.py args" (torchrun's default).
TEST_F(DdprunTest, PythonScript) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "no /usr/bin/python3 on this machine";
  const std::string script = path("hello.py");
  {
    std::ofstream(script) << "import os, sys\n"
                             "print('rank', os.environ['RANK'], 'args', sys.argv[1:])\n";
  }
  Command cmd = command({}, {});
  cmd.argv = {ddprun_, "--nproc-per-node", "2", script, "--lr", "3"};
  Result r = ddp::testing::run_command(cmd);
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 1]: rank 1 args ['--lr', '3']\n")) << r.out;
}

// Whether a TCP socket can bind `port` on every interface now.
bool bindable(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

// P and P + 1 both free (ddprun's store, then the Python workers' own), below the ephemeral
// range where the client sockets of tests running alongside land: pick_free_port() alone
// checked only P, and P + 1 was sometimes taken.
int free_port_pair() {
  std::mt19937 rng(std::random_device{}());
  for (int tries = 0; tries < 500; ++tries) {
    const int p = 20000 + static_cast<int>(rng() % 12000);
    if (bindable(p) && bindable(p + 1)) return p;
  }
  return ddp::net::pick_free_port();
}

// With several nodes a Python program's ranks cannot use the agent store (a TCPStore client does
// not speak ddp-cpp's protocol): they get the next port for PyTorch's env:// store, rank 0's.
TEST_F(DdprunTest, PythonWorkersOfSeveralNodesGetTheirOwnStorePort) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "no /usr/bin/python3 on this machine";
  const std::string script = path("env.py");
  {
    std::ofstream(script) << "import os\n"
                             "print(os.environ['MASTER_PORT'], os.environ['TORCHELASTIC_USE_AGENT_STORE'])\n";
  }
  int port = free_port_pair();
  auto node = [&](int k) {
    Command cmd = command({}, {});
    cmd.argv = {ddprun_, "--nnodes", "2", "--node-rank", std::to_string(k), "--master-port",
                std::to_string(port), script};
    return cmd;
  };
  Subprocess node0 = Subprocess::start(node(0));
  Result r1 = ddp::testing::run_command(node(1));
  ASSERT_TRUE(r1.exited(0)) << r1.describe();
  ASSERT_TRUE(node0.wait().exited(0)) << node0.wait().describe();
  EXPECT_TRUE(contains(r1.out, "[rank 1]: " + std::to_string(port + 1) + " False\n")) << r1.out;
  EXPECT_TRUE(contains(node0.wait().out, "[rank 0]: " + std::to_string(port + 1) + " False\n"))
      << node0.wait().out;

  // PyTorch's own DDP setup works there (python3-torch, when installed: a cross-check only).
  if (std::system("/usr/bin/python3 -c 'import torch.distributed' 2>/dev/null") != 0) return;
  {
    std::ofstream(script) << "import torch, torch.distributed as dist\n"
                             "dist.init_process_group('gloo')\n"
                             "t = torch.ones(1) * (dist.get_rank() + 1)\n"
                             "dist.all_reduce(t)\n"
                             "print('sum', int(t.item()))\n"
                             "dist.destroy_process_group()\n";
  }
  port = free_port_pair();  // fresh ports: the first job's sockets may linger
  auto torch_node = [&](int k) {
    Command cmd = node(k);
    cmd.env["PATH"] = "/usr/bin:/bin";  // Debian's python3, which has python3-torch
    // Debian trixie's PyTorch 2.6 is built without libuv, and env:// asks for a libuv TCPStore
    // unless USE_LIBUV=0 (1.13 ignores it).
    cmd.env["USE_LIBUV"] = "0";
    return cmd;
  };
  Subprocess torch0 = Subprocess::start(torch_node(0));
  Result t1 = ddp::testing::run_command(torch_node(1));
  ASSERT_TRUE(t1.exited(0)) << t1.describe() << "\nnode 0: " << torch0.wait().describe();
  ASSERT_TRUE(torch0.wait().exited(0)) << torch0.wait().describe();
  EXPECT_TRUE(contains(t1.out, "[rank 1]: sum 3\n")) << t1.out;
}

// --- usage errors

TEST_F(DdprunTest, NonexistentProgram) {
  Command cmd = command({"--nproc-per-node", "2"}, {});
  cmd.argv = {ddprun_, "--nproc-per-node", "2", path("no-such-program")};
  Result r = ddp::testing::run_command(cmd);
  EXPECT_TRUE(r.exited(127)) << r.describe();
  EXPECT_LT(r.wall_s, 5.0);
  EXPECT_TRUE(contains(r.err, "ddprun: cannot execute '" + path("no-such-program") +
                                  "': No such file or directory"))
      << r.err;

  cmd.argv = {ddprun_, "no-such-program-on-path-xyz"};
  r = ddp::testing::run_command(cmd);
  EXPECT_TRUE(r.exited(127)) << r.describe();
  EXPECT_TRUE(contains(r.err, "not found in PATH")) << r.err;
}

TEST_F(DdprunTest, BadFlagIsAUsageError) {
  Result r = run({"--nproc-per-nod", "2"}, {});
  EXPECT_TRUE(r.exited(2)) << r.describe();
  EXPECT_TRUE(contains(r.err, "unknown flag --nproc-per-nod")) << r.err;
  EXPECT_TRUE(contains(r.err, "ddprun --help")) << r.err;

  r = run({"--nproc-per-node", "lots"}, {});
  EXPECT_TRUE(r.exited(2)) << r.describe();
  EXPECT_TRUE(contains(r.err, "--nproc-per-node='lots'")) << r.err;

  r = run({"--nnodes", "1:2"}, {});
  EXPECT_TRUE(r.exited(2)) << r.describe();
  EXPECT_TRUE(contains(r.err, "--nnodes 1:2 is an elastic range, which needs the c10d rendezvous")) << r.err;
}

TEST_F(DdprunTest, Help) {
  Command cmd = command({}, {});
  cmd.argv = {ddprun_, "--help"};
  Result r = ddp::testing::run_command(cmd);
  EXPECT_TRUE(r.exited(0)) << r.describe();
  EXPECT_TRUE(contains(r.out, "--nproc-per-node")) << r.out;
  EXPECT_TRUE(contains(r.out, "--grace-period")) << r.out;
}

}  // namespace
// clang-format on
