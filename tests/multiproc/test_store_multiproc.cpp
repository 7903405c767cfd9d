// The rendezvous store in real jobs: attacked while a job runs (the job still finishes with the
// same result, rank 0's memory stays bounded, each intruder is logged with its address), and
// hosts that accept but never answer (a silent port, a SIGSTOPped rank 0, before and during
// the rendezvous, bare and under ddprun): every rank fails within its rendezvous timeout,
// naming the endpoint and the call that got no answer. Also: a wrong secret between nodes.
#include <arpa/inet.h>  // inet_ntop, inet_pton
#include <dirent.h>
#include <ifaddrs.h>  // getifaddrs
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "store/client.h"
#include "support/ranks.h"  // free_port
#include "support/store_peers.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Command;
using testing::RawPeer;
using testing::Result;
using testing::SilentListener;
using testing::Subprocess;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kWorker = testing::env_or_die("STORE_TEST_WORKER");

void expect_contains(const std::string& text, std::initializer_list<std::string> needles,
                     const std::string& context) {
  for (const auto& n : needles) {
    EXPECT_NE(text.find(n), std::string::npos) << "'" << n << "' not found\n" << context;
  }
}

class TempDir {
 public:
  TempDir() { path_ = ddp::testing::make_temp_dir("ddp_store_mp"); }
  ~TempDir() { fs::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void touch(const std::string& path) { std::ofstream(path) << "go\n"; }

// "[rank R]: result X" lines, in rank order.
std::vector<std::string> results(const std::string& out) {
  std::vector<std::string> lines;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("]: result ") != std::string::npos) lines.push_back(line);
  }
  std::sort(lines.begin(), lines.end());
  return lines;
}

// Children of `parent` (from /proc), with their RANK.
std::map<int, int> worker_pids_by_rank(int parent) {
  std::map<int, int> out;
  DIR* d = opendir("/proc");
  while (dirent* e = readdir(d)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    std::ifstream stat(fmt::format("/proc/{}/stat", pid));
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state;
    int ppid;
    rest >> state >> ppid;
    if (ppid != parent) continue;
    std::ifstream env(fmt::format("/proc/{}/environ", pid));
    std::string var;
    while (std::getline(env, var, '\0')) {
      if (var.rfind("RANK=", 0) == 0) out[std::atoi(var.c_str() + 5)] = pid;
    }
  }
  closedir(d);
  return out;
}

// True once something accepts connections on 127.0.0.1:`port` (the probe is a stranger to the
// store, closed at once: the store logs it).
bool listening(int port, double timeout_s) {
  return testing::wait_until(
      [&] {
        try {
          RawPeer probe(port);
          return true;
        } catch (const std::exception&) {
          return false;
        }
      },
      timeout_s);
}

// ---------------------------------------------------------------------------------------------
// Attacked while running.

TEST(StoreUnderAttack, TheJobFinishesWithTheSameResultAndRankZeroStaysSmall) {
  TempDir dir;
  const std::string secret = "the-jobs-secret";  // so that the test can also be a rogue member
  auto job = [&](const std::string& go) {
    return Subprocess::start({.argv = {kDdprun, "--standalone", "--nproc-per-node", "2",
                                       "--rdzv-timeout", "60", kWorker, go},
                              .env = {{"DDP_STORE_SECRET", secret}},
                              .timeout_s = 120});
  };
  // Undisturbed, for the reference result.
  touch(dir / "go-now");
  auto quiet = job(dir / "go-now");
  const Result& reference = quiet.wait();
  ASSERT_TRUE(reference.exited(0)) << reference.describe();
  ASSERT_EQ(results(reference.out).size(), 2u) << reference.describe();

  auto attacked = job(dir / "go");
  std::string out;  // what `m` points into
  std::smatch m;
  ASSERT_TRUE(testing::wait_until(
      [&] {
        out = attacked.out_so_far();
        return std::regex_search(out, m, std::regex("store-ready pid=(\\d+) port=(\\d+)"));
      },
      60))
      << attacked.out_so_far() << attacked.err_so_far();
  const std::string pid = m[1].str();
  const int port = std::stoi(m[2].str());
  const long hwm_before = testing::status_kib(pid, "VmHWM");
  ASSERT_GT(hwm_before, 0);

  std::vector<std::unique_ptr<RawPeer>> held;  // kept open until the job has ended
  std::map<std::string, std::string> logged;   // attacker address -> what the log must say
  auto stranger = [&](const std::string& payload, const std::string& says) {
    held.push_back(std::make_unique<RawPeer>(port));
    held.back()->send(payload);
    if (!says.empty()) logged[held.back()->address()] = says;
  };
  std::mt19937 rng(11);
  std::string noise(64 * 1024, '\0');
  for (char& c : noise) c = static_cast<char>(rng());
  stranger(noise, "not the store's handshake");
  stranger("GET / HTTP/1.1\r\nHost: localhost\r\n\r\n", "GET / HTTP/1.1");
  stranger(store::Writer().u32(1u << 30).body(), "1073741824 bytes before authenticating");
  // Half a hello, then silence: the oldest waiting stranger once the idle ones come.
  stranger(std::string("\x46\x00\x00\x00"
                       "DDPST",
                       9),
           "made room");
  // A process that speaks the protocol but lacks the secret.
  store::ClientOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.key = store::job_key("a-guess", "");
  o.identity = "an intruder";
  o.who = "[intruder]";
  o.owner = "rank 0";
  store::Client intruder(o);
  EXPECT_THROW(intruder.set("ddp/poison", "x", store::Clock::now() + std::chrono::seconds(5)),
               RendezvousError);
  // Members gone wrong (they hold the secret): a half request held open, a 1 GiB frame.
  held.push_back(std::make_unique<RawPeer>(port));
  ASSERT_TRUE(held.back()->authenticate(store::job_key(secret, "")));
  store::Writer half;
  half.u8(1).bytes("ddp/half").bytes(std::string(4096, 'v'));
  held.back()->send(half.frame().substr(0, 2000));
  held.push_back(std::make_unique<RawPeer>(port));
  ASSERT_TRUE(held.back()->authenticate(store::job_key(secret, "")));
  held.back()->send(store::Writer().u32(1u << 30).body());
  logged[held.back()->address()] = "1073741824 bytes; the limit is";
  // Hundreds of idle connections.
  for (int i = 0; i < 300; ++i) held.push_back(std::make_unique<RawPeer>(port));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const long hwm_after = testing::status_kib(pid, "VmHWM");
  std::printf("[ measured ] rank 0's VmHWM: %ld KiB before the attacks, %ld KiB after (+%ld)\n",
              hwm_before, hwm_after, hwm_after - hwm_before);
  EXPECT_LT(hwm_after - hwm_before, 64 * 1024)
      << "rank 0's peak memory grew by " << (hwm_after - hwm_before) << " KiB under attack";

  touch(dir / "go");
  const auto released = std::chrono::steady_clock::now();
  const Result& r = attacked.wait();
  const double after_go =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - released).count();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_EQ(results(r.out), results(reference.out)) << r.describe();
  // The attackers still hold their sockets: the job does not wait for them.
  EXPECT_LT(after_go, 30.0) << r.describe();
  std::printf(
      "[ measured ] the job ended %.1f s after it was let go, with %zu attackers' "
      "sockets still open\n",
      after_go, held.size());
  const std::string where = fmt::format("[rank 0]: ddp: rendezvous store 127.0.0.1:{}: ", port);
  for (const auto& [address, says] : logged) {
    const size_t at = r.err.find(address);
    ASSERT_NE(at, std::string::npos) << address << " not logged\n" << r.err;
    const size_t line_start = r.err.rfind('\n', at) + 1;
    const std::string line = r.err.substr(line_start, r.err.find('\n', at) - line_start);
    expect_contains(line, {where, says}, r.err);
  }
  expect_contains(r.err,
                  {"wrong job key", "(an intruder)", "64 connections were waiting to authenticate"},
                  r.err);
  held.clear();
}

// The non-loopback IPv4 addresses of this host.
std::vector<std::string> other_addresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN] = {0};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    if (std::string(buf).rfind("127.", 0) != 0) out.push_back(buf);
  }
  ::freeifaddrs(list);
  return out;
}

// ddprun --standalone: the store listens on 127.0.0.1 only, not on the host's other addresses.
TEST(StoreUnderAttack, StandaloneListensOnLoopbackOnly) {
  TempDir dir;
  auto job = Subprocess::start(
      {.argv = {kDdprun, "--standalone", "--nproc-per-node", "2", kWorker, dir / "go"},
       .timeout_s = 120});
  std::string out;  // what `m` points into
  std::smatch m;
  ASSERT_TRUE(testing::wait_until(
      [&] {
        out = job.out_so_far();
        return std::regex_search(out, m, std::regex("store-ready pid=(\\d+) port=(\\d+)"));
      },
      60))
      << job.out_so_far() << job.err_so_far();
  const int port = std::stoi(m[2].str());
  const std::vector<std::string> others = other_addresses();
  for (const std::string& address : others) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, address.c_str(), &a.sin_addr);
    const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    const int err = errno;
    ::close(fd);
    EXPECT_TRUE(rc != 0 && err == ECONNREFUSED)
        << "the store of a --standalone job answered on " << address << ":" << port;
  }
  touch(dir / "go");
  const Result& r = job.wait();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_EQ(r.err.find("every interface"), std::string::npos) << r.describe();
  if (others.empty()) GTEST_SKIP() << "this host has no address but loopback to try";
}

// ---------------------------------------------------------------------------------------------
// Hosts that accept but never answer.

Command one_rank(int rank, int world, int port, const std::string& timeout_s) {
  return {.argv = {kWorker, "/nonexistent-go-file"},
          .env = {{"RANK", std::to_string(rank)},
                  {"WORLD_SIZE", std::to_string(world)},
                  {"MASTER_ADDR", "127.0.0.1"},
                  {"MASTER_PORT", std::to_string(port)},
                  {"DDP_RDZV_TIMEOUT", timeout_s},
                  {"DDP_STORE_SECRET", "s"}},
          .timeout_s = 60};
}

TEST(SilentStore, APortThatNeverAnswersEndsTheRankInTime) {
  SilentListener silent;
  for (bool agent : {false, true}) {
    SCOPED_TRACE(agent ? "torchrun's agent store (a TCPStore client)" : "a ddp-cpp store");
    Command cmd = one_rank(1, 2, silent.port(), "3");
    if (agent) cmd.env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    const Result r = testing::run_command(cmd);
    EXPECT_EQ(r.exit_code, 1) << r.describe();
    EXPECT_LT(r.wall_s, 12.0) << r.describe();
    expect_contains(r.err,
                    {"[rank 1]", fmt::format("127.0.0.1:{}", silent.port()), "did not answer",
                     "SIGSTOP"},
                    r.describe());
  }
}

TEST(SilentStore, AStoppedRankZeroBeforeRankOneConnects) {
  const int port = testing::free_port();
  auto rank0 = Subprocess::start(one_rank(0, 2, port, "60"));
  ASSERT_TRUE(listening(port, 30)) << rank0.err_so_far();
  ::kill(rank0.pid(), SIGSTOP);
  const Result r = testing::run_command(one_rank(1, 2, port, "3"));
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_LT(r.wall_s, 12.0) << r.describe();
  expect_contains(r.err,
                  {"[rank 1]", fmt::format("127.0.0.1:{}", port),
                   "accepted the connection but did not answer", "rank 0"},
                  r.describe());
  ::kill(rank0.pid(), SIGKILL);
}

TEST(SilentStore, AStoppedRankZeroDuringTheCount) {
  const int port = testing::free_port();
  // Three ranks expected, two started: both count until rank 0 is stopped.
  auto rank0 = Subprocess::start(one_rank(0, 3, port, "60"));
  ASSERT_TRUE(listening(port, 30)) << rank0.err_so_far();
  auto rank1 = Subprocess::start(one_rank(1, 3, port, "8"));
  // Rank 1 is counting once "joined" is 2 (read as a member: the test has the secret).
  store::ClientOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.key = store::job_key("s", "");
  o.who = "[test]";
  o.owner = "rank 0";
  store::Client observer(o);
  const std::string joined = "ddp/none/attempt_0/default//joined";
  ASSERT_TRUE(testing::wait_until(
      [&] {
        const auto d = store::Clock::now() + std::chrono::seconds(2);
        return observer.check({joined}, d) && observer.add(joined, 0, d) == 2;
      },
      30))
      << rank1.err_so_far();
  ::kill(rank0.pid(), SIGSTOP);
  const Result& r = rank1.wait();
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_LT(r.wall_s, 20.0) << r.describe();
  expect_contains(r.err,
                  {"[rank 1]", fmt::format("127.0.0.1:{}", port), "did not answer", "rank 0"},
                  r.describe());
  // Not the ordinary rendezvous timeout: the store's silence is what it reports.
  EXPECT_EQ(r.err.find("ranks joined after"), std::string::npos) << r.describe();
  ::kill(rank0.pid(), SIGKILL);
}

Command node(int node_rank, int port, const std::string& timeout_s, const std::string& secret) {
  return {.argv = {kDdprun, "--nnodes", "2", "--node-rank", std::to_string(node_rank),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                   std::to_string(port), "--rdzv-timeout", timeout_s, "--grace-period", "1",
                   kWorker, "/nonexistent-go-file"},
          .env = {{"DDP_STORE_SECRET", secret}},
          .timeout_s = 60};
}

// With several nodes node 0's ddprun hosts the store (Note [Restart rounds]): frozen, it is named
// by the other node's ddprun within that node's rendezvous timeout.
TEST(SilentStore, AStoppedStoreHostUnderDdprun) {
  const int port = testing::free_port();
  auto node0 = Subprocess::start(node(0, port, "60", "s"));
  ASSERT_TRUE(listening(port, 30)) << node0.err_so_far();
  ::kill(node0.pid(), SIGSTOP);
  const Result r = testing::run_command(node(1, port, "4", "s"));
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_LT(r.wall_s, 20.0) << r.describe();
  expect_contains(r.err,
                  {"node 1", "agent store", fmt::format("127.0.0.1:{}", port), "did not answer",
                   "is stopped"},
                  r.describe());
  ::kill(node0.pid(), SIGKILL);
}

TEST(StoreSecret, ANodeWithAnotherSecretIsRefusedAndNamed) {
  const int port = testing::free_port();
  auto node0 = Subprocess::start(node(0, port, "5", "secret-a"));
  ASSERT_TRUE(listening(port, 30)) << node0.err_so_far();
  const Result r1 = testing::run_command(node(1, port, "5", "secret-b"));
  EXPECT_EQ(r1.exit_code, 1) << r1.describe();
  EXPECT_LT(r1.wall_s, 5.0) << "refused only at the timeout\n" << r1.describe();
  expect_contains(r1.err,
                  {"node 1", fmt::format("127.0.0.1:{}", port), "refused this process",
                   "DDP_STORE_SECRET"},
                  r1.describe());
  const Result& r0 = node0.wait();
  EXPECT_EQ(r0.exit_code, 1) << r0.describe();
  expect_contains(r0.err,
                  {"ddprun: rendezvous store", "wrong job key", "1/2 nodes joined restart round 0",
                   "missing nodes: 1"},
                  r0.describe());
}

}  // namespace
}  // namespace ddp
