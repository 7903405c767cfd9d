// Elastic jobs across hosts for real (Note [Elastic rounds] in tools/ddprun/elastic.h): network
// namespaces as hosts (support/netns.h), one ddprun per host with --nnodes MIN:MAX and the c10d
// rendezvous on host 0 (which hosts the store), two ddp-train workers per host, training an mlp
// whose steps last at least 250 ms (--min-step-ms: the job runs about as long as a CNN's did on 2
// cores, at a third of its CPU-seconds, which the test suite needs elsewhere). A host whose
// processes are all SIGKILLed drops out and the job goes on without it; started again, it is
// admitted and the job grows back; a host told SIGTERM (a spot reclaim's notice) leaves with a
// checkpoint and the others go on; a host over MAX waits; fewer than MIN fail naming the missing;
// the store's host cut off alone waits for a majority while the others go on; so does any side
// of a partition without a majority (2 | 2, 3 | 1 for a minute, a link that flaps), watched
// while it lasts for two groups training at once (GroupWatch).
// Every training run ends with the exact-once check of its sample log (Note [Sample log] in
// tools/ddp_train/trainer.cpp): each epoch, across all the sizes it ran at, used every sample
// once (PyTorch's padding aside: at most world size - 1 repeats, in an epoch's last step).
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/etcd.h"
#include "support/netns.h"
#include "support/saved_state.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

// Command lines are laid out by hand (a flag with its value), which clang-format would put one
// string per line.
// clang-format off
namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Hosts;
using testing::Result;
using testing::Subprocess;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kTrain = testing::env_or_die("DDP_TRAIN");

constexpr int kSamples = 3072;  // --train-subset
constexpr int kEpochs = 2;

// What the sample log says the final model was trained on: per epoch, every index of the steps
// of the last attempt that ran each step, and the world sizes the epoch ran at.
struct Epoch {
  std::vector<int64_t> indices;
  std::set<int> worlds;
};

std::map<int64_t, Epoch> trained_samples(const fs::path& dir) {
  // attempt -> step -> (epoch, world, indices of every rank)
  struct Step {
    int64_t epoch = 0;
    int world = 0;
    std::vector<int64_t> indices;
  };
  std::map<int, std::map<int64_t, Step>> attempts;
  for (const auto& file : fs::directory_iterator(dir)) {
    int attempt = 0;
    if (std::sscanf(file.path().filename().c_str(), "attempt%d.", &attempt) != 1) continue;
    std::ifstream in(file.path());
    std::string line;
    while (std::getline(in, line)) {
      if (in.eof()) break;  // a last line without its newline: cut by SIGKILL
      std::istringstream words(line);
      Step s;
      int64_t step = 0;
      words >> s.epoch >> step >> s.world;
      Step& into = attempts[attempt][step];
      into.epoch = s.epoch;
      into.world = s.world;
      for (int64_t i; words >> i;) into.indices.push_back(i);
    }
  }
  // The lineage: an attempt resumed from a checkpoint redoes every step from its first on.
  std::map<int64_t, Step> lineage;
  for (auto& [attempt, steps] : attempts) {
    if (steps.empty()) continue;
    lineage.erase(lineage.lower_bound(steps.begin()->first), lineage.end());
    for (auto& [step, s] : steps) lineage[step] = std::move(s);
  }
  std::map<int64_t, Epoch> epochs;
  for (auto& [step, s] : lineage) {
    Epoch& e = epochs[s.epoch];
    e.indices.insert(e.indices.end(), s.indices.begin(), s.indices.end());
    e.worlds.insert(s.world);
  }
  return epochs;
}

// How a job under test ended: it ran to its last epoch, or the test ended it (end_now) once it
// had seen what it came for, in the middle of an epoch.
enum class Ended { kFinished, kKilled };

// Each epoch used every one of the kSamples samples, each once except for the sampler's padding.
// A job the test killed: each epoch but the last it reached (at most num_epochs) in full, and
// the last one no sample twice.
void expect_each_sample_once(const fs::path& dir, int num_epochs = kEpochs,
                             Ended ended = Ended::kFinished) {
  const auto epochs = trained_samples(dir);
  if (ended == Ended::kFinished) {
    ASSERT_EQ(static_cast<int>(epochs.size()), num_epochs) << "epochs in the sample log";
  } else {
    ASSERT_GE(static_cast<int>(epochs.size()), 1) << "epochs in the sample log";
    ASSERT_LE(static_cast<int>(epochs.size()), num_epochs) << "epochs in the sample log";
  }
  for (const auto& [epoch, e] : epochs) {
    const bool partial = ended == Ended::kKilled && epoch == epochs.rbegin()->first;
    std::map<int64_t, int> seen;
    for (int64_t i : e.indices) ++seen[i];
    int missing = 0, repeats = 0;
    for (int64_t i = 0; i < kSamples; ++i) {
      if (seen.count(i) == 0) ++missing;
    }
    for (const auto& [i, n] : seen) repeats += n - 1;
    if (!partial) {
      EXPECT_EQ(missing, 0) << "epoch " << epoch;
      EXPECT_EQ(static_cast<int64_t>(seen.size()), kSamples) << "epoch " << epoch;
    }
    EXPECT_LT(repeats, *e.worlds.rbegin()) << "epoch " << epoch << ": more repeats than padding";
    std::printf("[ measured ] epoch %ld%s: %zu samples trained, %d distinct of %d, %d repeat(s) "
                "(padding), at world size(s) %s\n",
                static_cast<long>(epoch), partial ? " (ended by the test)" : "", e.indices.size(),
                static_cast<int>(seen.size()), kSamples, repeats,
                fmt::format("{}", fmt::join(e.worlds, ", ")).c_str());
  }
}

// The newest step checkpoint in `dir` (-1: none).
int64_t newest_step(const fs::path& dir) {
  int64_t newest = -1;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t at = name.find("-step=");
    if (at != std::string::npos) newest = std::max<int64_t>(newest, std::atoll(name.c_str() + at + 6));
  }
  return newest;
}

// The run folder's history (run.lease.log, Note [Run folder lease] in ddp/run_lease.h): every
// group that took the folder belongs to one instance of the job (one lineage), each in a newer
// round than the one before, and the last one released it at the end (a job the test killed
// keeps its lease).
void expect_one_lineage(const fs::path& run, Ended ended = Ended::kFinished) {
  std::ifstream in(run / "run.lease.log");
  std::string line, lineage;
  int64_t round = -1;
  int takes = 0;
  const std::regex take(R"( take job '[^']*' \(lineage (\w+), round (\d+)\))");
  while (std::getline(in, line)) {
    std::smatch m;
    if (!std::regex_search(line, m, take)) continue;
    ++takes;
    if (lineage.empty()) lineage = m[1];
    EXPECT_EQ(m[1], lineage) << "two instances of the job wrote into " << run << ": " << line;
    EXPECT_GT(std::stoll(m[2]), round) << "a round took the folder after a newer one: " << line;
    round = std::stoll(m[2]);
  }
  EXPECT_GT(takes, 0) << run / "run.lease.log";
  if (ended == Ended::kFinished) {
    EXPECT_FALSE(fs::exists(run / "run.lease")) << "the last holder did not release the folder";
  }
  std::printf("[ measured ] run folder: %d group(s) of one lineage took it in turn, rounds up to "
              "%ld\n", takes, static_cast<long>(round));
}

// Note [Two groups at once]: watches a sample log while a test cuts the network. Every 200 ms it
// lists the files (attempt<A>.rank<R>.pid<P>.txt, one per rank of a group) that grew since the
// last look. Two groups training at once show as one rank number written by two processes in the
// same look: each group has its own rank 0, 1, ... A handoff from one round to the next takes
// longer than a look (the old group stops, new workers load LibTorch and a checkpoint), so one
// group following another never shows as two.
class GroupWatch {
 public:
  explicit GroupWatch(fs::path dir) : dir_(std::move(dir)), thread_([this] { run(); }) {}
  ~GroupWatch() { stop(); }
  // Stops watching; what it saw: "" if one group at most trained at every look, else the first
  // look that saw two.
  std::string stop() {
    if (!thread_.joinable()) return two_;
    done_ = true;
    thread_.join();
    std::printf("[ measured ] sample log watched %d times: %d with ranks training, %s\n", looks_,
                busy_, two_.empty() ? "one group at most each time" : "TWO GROUPS at once");
    return two_;
  }

 private:
  void run() {
    std::map<std::string, uintmax_t> sizes;
    for (bool first = true; !done_; first = false) {
      if (!first) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::map<int, std::vector<std::string>> writers;  // rank -> files that grew
      std::error_code ec;
      for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        int attempt = 0, rank = 0;
        if (std::sscanf(name.c_str(), "attempt%d.rank%d.", &attempt, &rank) != 2) continue;
        const uintmax_t size = fs::file_size(it->path(), ec);
        if (ec) continue;
        uintmax_t& was = sizes[name];
        if (size > was) writers[rank].push_back(name);
        was = size;
      }
      if (first) continue;  // the files' sizes when the watch began
      ++looks_;
      if (!writers.empty()) ++busy_;
      for (const auto& [rank, files] : writers) {
        if (files.size() > 1 && two_.empty()) {
          two_ = fmt::format("rank {} written by {} processes in one look: {}", rank,
                             files.size(), fmt::join(files, ", "));
        }
      }
    }
  }

  fs::path dir_;
  std::atomic<bool> done_{false};
  int looks_ = 0, busy_ = 0;
  std::string two_;
  std::thread thread_;  // last: starts once the rest is built
};

class Elastic : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!Hosts::available(&why) || !Hosts::usable(&why)) GTEST_SKIP() << why;
    dir_ = ddp::testing::make_temp_dir("ddp_elastic");
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // ddprun on host k, --nnodes `range`, 2 workers, the rendezvous (and store) on host 0, or in
  // the etcd cluster at etcd_ when set.
  Subprocess node(const Hosts& hosts, int k, const std::string& range,
                  std::vector<std::string> program, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {
        kDdprun, "--nnodes", range, "--nproc-per-node", "2",
        "--rdzv-backend", etcd_.empty() ? "c10d" : "etcd",
        "--rdzv-endpoint", etcd_.empty() ? hosts.address(0) + ":29500" : etcd_,
        "--rdzv-id", "elastic", "--rdzv-conf", "last_call_timeout=1,join_timeout=30",
        "--max-restarts", "3", "--collective-timeout", "30", "--grace-period", "10"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), program.begin(), program.end());
    return hosts.start(k, argv, {{"DDP_DEBUG", "info"}}, 300);
  }

  std::vector<std::string> train(const std::string& name, int epochs = kEpochs) const {
    return {kTrain, "--model", "mlp", "--min-step-ms", "250", "--epochs", std::to_string(epochs),
            "--train-subset", std::to_string(kSamples), "--test-subset", "500",
            "--batch-size", "32", "--checkpoint-every", "2", "--resume", "auto", "--no-plots",
            "--workers", "1", "--log-every", "1", "--output-dir", (dir_ / name).string(),
            "--sample-log", (dir_ / name / "samples").string()};
  }

  // When `p` (its elapsed seconds) said `text` in its stderr past offset `from`, waiting up to
  // `limit_s`; -1 if it did not.
  static double when_said(Subprocess& p, const std::string& text, size_t from, double limit_s) {
    double at = -1;
    testing::wait_until([&] {
      if (p.err_so_far().find(text, from) == std::string::npos) return false;
      at = p.elapsed_s();
      return true;
    }, limit_s);
    return at;
  }

  // Ends a job that showed what its test came for: once it trained a step past `step` (its
  // newest checkpoint, in `ckpts`), every process of every host is SIGKILLed, so that the epochs
  // it still had to run cost nothing (a test that needs the job to run long through a partition
  // gives it many). Every host was still running: nobody had failed or left.
  void end_now(const Hosts& hosts, std::vector<std::optional<Subprocess>>& h,
               const fs::path& ckpts, int64_t step) {
    EXPECT_TRUE(testing::wait_until([&] { return newest_step(ckpts) > step; }, 60))
        << "no step checkpointed past " << step;
    for (size_t k = 0; k < h.size(); ++k) {
      EXPECT_GT(hosts.processes(static_cast<int>(k)), 0)
          << "host " << k << " ended before the test ended the job: " << h[k]->err_so_far();
    }
    // Again until each host is empty: a process forked meanwhile, or one killed but not yet
    // reaped by its new parent, still shows in the namespace.
    const int n = static_cast<int>(h.size());
    testing::wait_until([&] {
      bool empty = true;
      for (int k = 0; k < n; ++k) {
        if (hosts.processes(k) == 0) continue;
        empty = false;
        std::system(fmt::format("ip netns pids {} | xargs -r kill -9", hosts.host(k)).c_str());
      }
      return empty;
    }, 20);
    for (auto& p : h) p->wait();
  }

  // An etcd member on each of `at` (port 2379), up and with a leader; etcd_ its endpoints.
  std::unique_ptr<testing::EtcdCluster> etcd_on(const Hosts& hosts, std::vector<int> at) {
    std::vector<testing::EtcdCluster::Member> members;
    for (int k : at) members.push_back({hosts.address(k), 2379, 2380});
    auto cluster = std::make_unique<testing::EtcdCluster>(
        members,
        [&hosts, at](int m, const std::vector<std::string>& argv) {
          return hosts.start(at[m], argv, {}, 600);
        },
        [this, &hosts, at](int m) { return !ask_etcd(hosts, at[m], "/v3/kv/range",
                                                     R"({"key":"aGVhbHRo"})").empty(); });
    etcd_ = cluster->endpoints();
    return cluster;
  }
  // What the member on host k answers at `path` ("" for no answer), asked from that host.
  std::string ask_etcd(const Hosts& hosts, int k, const std::string& path,
                       const std::string& body) const {
    const std::string code = fmt::format(
        "import sys, urllib.request\n"
        "r = urllib.request.urlopen(urllib.request.Request('http://{}:2379{}', data=b'{}'), "
        "timeout=1)\n"
        "sys.stdout.write(r.read().decode())\n", hosts.address(k), path, body);
    Subprocess p = hosts.start(k, {"/usr/bin/python3", "-c", code}, {}, 10);
    const Result& r = p.wait();
    return r.exited(0) ? r.out : "";
  }

  fs::path dir_;
  std::string etcd_;  // --rdzv-endpoint of --rdzv-backend etcd; empty: c10d on host 0
};

// 3 hosts, --nnodes 2:3: every process of host 2 is SIGKILLed mid-epoch; hosts 0 and 1 go on
// at 2 nodes from the last checkpoint; host 2's ddprun started again is admitted and the job
// grows back to 3. The run ends with every sample of each epoch used once.
TEST_F(Elastic, AKilledHostDropsOutAndAdmittedAgainGrowsTheJobBack) {
  Hosts hosts(3);
  std::vector<std::optional<Subprocess>> h(3);
  for (int k = 0; k < 3; ++k) h[k].emplace(node(hosts, k, "2:3", train("run")));
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  ASSERT_TRUE(testing::wait_until([&] {
    return h[0]->err_so_far().find("elastic round 0: 3 node(s)") != std::string::npos &&
           fs::exists(ckpts / "epoch=0-step=4.ckpt");
  }, 180)) << h[0]->err_so_far() << h[0]->out_so_far();

  // Host 2 fails whole: its ddprun and both workers.
  const size_t before = h[0]->err_so_far().size();
  std::system(fmt::format("ip netns pids {} | xargs -r kill -9", hosts.host(2)).c_str());
  const double killed_at = h[0]->elapsed_s();
  h[2]->wait();
  double shrunk_at = -1, resumed_at = -1;
  ASSERT_TRUE(testing::wait_until([&] {
    const std::string err = h[0]->err_so_far();
    if (shrunk_at < 0 && err.find("elastic round 1: 2 node(s)", before) != std::string::npos) {
      shrunk_at = h[0]->elapsed_s();
    }
    // Rank 0 prints it, on whichever survivor is node 0.
    if (resumed_at < 0 && (h[0]->out_so_far() + h[1]->out_so_far()).find("resumed from") !=
                              std::string::npos) {
      resumed_at = h[0]->elapsed_s();
    }
    return shrunk_at >= 0 && resumed_at >= 0;
  }, 90)) << h[0]->err_so_far() << h[0]->out_so_far();
  std::printf("[ measured ] host 2 killed: the 2 survivors re-formed %.1f s later, and resumed "
              "training (rank 0's \"resumed from\") %.1f s after the kill\n",
              shrunk_at - killed_at, resumed_at - killed_at);
  EXPECT_LT(resumed_at - killed_at, 20) << "goal: under 10 s on an idle machine";

  // Its scheduler starts host 2 again: admitted when the job next re-forms, at once.
  const size_t before_grow = h[0]->err_so_far().size();
  h[2].emplace(node(hosts, 2, "2:3", train("run")));
  double grown_at = -1;
  ASSERT_TRUE(testing::wait_until([&] {
    if (h[0]->err_so_far().find("elastic round 2: 3 node(s)", before_grow) == std::string::npos) {
      return false;
    }
    grown_at = h[2]->elapsed_s();
    return true;
  }, 90)) << h[0]->err_so_far() << h[2]->err_so_far();
  std::printf("[ measured ] host 2 started again: admitted (round of 3 nodes formed) %.1f s after "
              "its ddprun started\n", grown_at);

  for (int k = 0; k < 3; ++k) {
    const Result& r = h[k]->wait();
    EXPECT_TRUE(r.exited(0)) << "host " << k << ": " << r.describe();
  }
  const std::string err0 = h[0]->wait().err;
  EXPECT_NE(err0.find("not counted as a restart"), std::string::npos) << err0;
  expect_each_sample_once(dir_ / "run" / "samples");
  expect_one_lineage(dir_ / "run");
  for (int k = 0; k < 3; ++k) EXPECT_EQ(hosts.processes(k), 0);
}

// The same with host 0, whose ddprun hosts the store (Note [Moving the store] in
// tools/ddprun/elastic.cpp): the survivors move the store to the first of them and go on at 2
// nodes; host 0's ddprun started again hosts a fresh store at the endpoint, where the moved job
// finds it waiting, moves its store back and admits it.
TEST_F(Elastic, TheStoresHostKilledTheOthersMoveTheStoreAndTakeItBackWhenItReturns) {
  Hosts hosts(3);
  std::vector<std::optional<Subprocess>> h(3);
  for (int k = 0; k < 3; ++k) h[k].emplace(node(hosts, k, "2:3", train("run")));
  ASSERT_TRUE(testing::wait_until([&] {
    return h[1]->err_so_far().find("elastic round 0: 3 node(s)") != std::string::npos &&
           fs::exists(dir_ / "run" / "checkpoints" / "epoch=0-step=4.ckpt");
  }, 180)) << h[1]->err_so_far() << h[1]->out_so_far();
  std::system(fmt::format("ip netns pids {} | xargs -r kill -9", hosts.host(0)).c_str());
  const double killed_at = h[1]->elapsed_s();
  h[0]->wait();
  double moved_at = -1, resumed_at = -1;
  ASSERT_TRUE(testing::wait_until([&] {
    const std::string err = h[1]->err_so_far();
    if (moved_at < 0 && err.find("elastic round 1: 2 node(s)") != std::string::npos) {
      moved_at = h[1]->elapsed_s();
    }
    if (resumed_at < 0 && (h[1]->out_so_far() + h[2]->out_so_far()).find("resumed from") !=
                              std::string::npos) {
      resumed_at = h[1]->elapsed_s();
    }
    return moved_at >= 0 && resumed_at >= 0;
  }, 90)) << h[1]->err_so_far() << h[2]->err_so_far();
  EXPECT_NE(h[1]->err_so_far().find("stopped answering"), std::string::npos)
      << h[1]->err_so_far();
  std::printf("[ measured ] the store's host killed: the 2 survivors moved the store and "
              "re-formed %.1f s later, resumed training %.1f s after the kill\n",
              moved_at - killed_at, resumed_at - killed_at);

  h[0].emplace(node(hosts, 0, "2:3", train("run")));
  double grown_at = -1;
  ASSERT_TRUE(testing::wait_until([&] {
    if (h[0]->err_so_far().find("3 node(s)") == std::string::npos) return false;
    grown_at = h[0]->elapsed_s();
    return true;
  }, 90)) << h[0]->err_so_far() << h[1]->err_so_far();
  std::printf("[ measured ] host 0 started again: the job took its store back and admitted it "
              "%.1f s after its ddprun started\n", grown_at);
  for (int k = 0; k < 3; ++k) {
    const Result& r = h[k]->wait();
    EXPECT_TRUE(r.exited(0)) << "host " << k << ": " << r.describe();
  }
  EXPECT_NE(h[1]->wait().err.find("back to the rendezvous endpoint"), std::string::npos)
      << h[1]->wait().err;
  expect_each_sample_once(dir_ / "run" / "samples");
  expect_one_lineage(dir_ / "run");
  for (int k = 0; k < 3; ++k) EXPECT_EQ(hosts.processes(k), 0);
}

// A spot reclaim's notice: SIGTERM to one host's ddprun. Its workers and everyone else's stop
// after the same step with a checkpoint; the host leaves (its ddprun ending by the signal, as
// torchrun's does) and the other two go on at 2 nodes from that checkpoint. Host 1, then host 0,
// which hosts the store: it goes at once and the others move the store (Note [Moving the
// store]).
TEST_F(Elastic, ASigtermNoticeLetsTheNodeLeaveWithACheckpointAndTheOthersGoOn) {
  for (const int leaving : {1, 0}) {
    SCOPED_TRACE(fmt::format("host {} leaves", leaving));
    const std::string name = fmt::format("run{}", leaving);
    const int a = leaving == 0 ? 1 : 0, b = 2;  // the two that stay
    Hosts hosts(3);
    std::vector<std::optional<Subprocess>> h(3);
    for (int k = 0; k < 3; ++k) h[k].emplace(node(hosts, k, "2:3", train(name)));
    ASSERT_TRUE(testing::wait_until([&] {
      return h[a]->err_so_far().find("elastic round 0: 3 node(s)") != std::string::npos &&
             fs::exists(dir_ / name / "checkpoints" / "epoch=0-step=4.ckpt");
    }, 180)) << h[a]->err_so_far() << h[a]->out_so_far();
    h[leaving]->signal(SIGTERM);
    const double notice_at = h[a]->elapsed_s();
    const Result& gone = h[leaving]->wait();
    EXPECT_EQ(gone.term_signal, SIGTERM) << "ddprun ends by the signal it got: " << gone.describe();
    EXPECT_NE(gone.err.find("this node leaves the elastic job, the others go on"),
              std::string::npos) << gone.describe();
    double resumed_at = -1;
    ASSERT_TRUE(testing::wait_until([&] {
      if (h[a]->err_so_far().find("elastic round 1: 2 node(s)") == std::string::npos ||
          (h[a]->out_so_far() + h[b]->out_so_far()).find("resumed from") == std::string::npos) {
        return false;
      }
      resumed_at = h[a]->elapsed_s();
      return true;
    }, 90)) << h[a]->err_so_far() << h[a]->out_so_far() << h[b]->out_so_far();
    std::printf("[ measured ] SIGTERM to host %d%s: the other 2 resumed %.1f s after the notice\n",
                leaving, leaving == 0 ? " (the store's host)" : "", resumed_at - notice_at);
    const Result& ra = h[a]->wait();
    const Result& rb = h[b]->wait();
    EXPECT_TRUE(ra.exited(0)) << ra.describe();
    EXPECT_TRUE(rb.exited(0)) << rb.describe();
    // The workers stopped as for a preemption: a checkpoint at the step every rank agreed on,
    // from which the two go on (rank 0 of round 0 was on whichever host arrived first).
    const std::string outs = ra.out + gone.out + rb.out;
    const size_t at = outs.find("preempted at step ");
    ASSERT_NE(at, std::string::npos) << outs;
    const int stopped = std::atoi(outs.c_str() + at + std::strlen("preempted at step "));
    EXPECT_NE(outs.find(fmt::format("at epoch 0, step {} (written at world size 6, now 4",
                                    stopped)),
              std::string::npos) << outs;
    EXPECT_NE(ra.err.find("leaves: its ddprun received SIGTERM"), std::string::npos) << ra.err;
    EXPECT_EQ(ra.err.find("restarting it"), std::string::npos) << "not a failure: " << ra.err;
    if (leaving == 0) {
      // It said so: the others moved the store before re-forming, not once it vanished.
      EXPECT_NE(ra.err.find("is going away with its host, which leaves the job; it moved to"),
                std::string::npos)
          << ra.err;
    }
    expect_each_sample_once(dir_ / name / "samples");
    expect_one_lineage(dir_ / name);
    for (int k = 0; k < 3; ++k) EXPECT_EQ(hosts.processes(k), 0);
  }
}

// Note [Never two groups] across a real partition: 3 hosts, --nnodes 1:3, host 0 (whose ddprun
// hosts the store) cut off alone. The 2 others are a majority of the last round: they move the
// store and go on. Host 0 keeps the old store and MIN is 1, so without the rule it would train
// alone into the same run folder; with it, it waits for a majority. When the link comes back
// the job finds host 0 waiting at the endpoint, moves its store back and runs whole again; the
// sample log shows every sample of each epoch trained once: one group at every step.
TEST_F(Elastic, AStoreHostCutOffAloneNeverTrainsAndTheJobHealsWhole) {
  Hosts hosts(3);
  const std::vector<std::string> extra = {"--rdzv-conf", "last_call_timeout=1,join_timeout=120",
                                          "--collective-timeout", "15"};
  std::vector<std::optional<Subprocess>> h(3);
  for (int k = 0; k < 3; ++k) h[k].emplace(node(hosts, k, "1:3", train("run"), extra));
  ASSERT_TRUE(testing::wait_until([&] {
    return h[1]->err_so_far().find("elastic round 0: 3 node(s)") != std::string::npos &&
           fs::exists(dir_ / "run" / "checkpoints" / "epoch=0-step=4.ckpt");
  }, 180)) << h[1]->err_so_far() << h[1]->out_so_far();

  GroupWatch watch(dir_ / "run" / "samples");
  hosts.set_link(0, false);
  const double cut_at = h[1]->elapsed_s();
  double resumed_at = -1;
  ASSERT_TRUE(testing::wait_until([&] {
    if (h[1]->err_so_far().find(": 2 node(s)") == std::string::npos ||
        (h[1]->out_so_far() + h[2]->out_so_far()).find("resumed from") == std::string::npos) {
      return false;
    }
    resumed_at = h[1]->elapsed_s();
    return true;
  }, 120)) << h[1]->err_so_far() << h[2]->err_so_far();
  std::printf("[ measured ] store's host cut off: the 2 others moved the store and resumed "
              "training %.1f s after the cut\n", resumed_at - cut_at);
  // Host 0's round failed (its peers went silent) and it waits for a majority it cannot have.
  ASSERT_TRUE(testing::wait_until([&] {
    return h[0]->err_so_far().find("waits for a majority of the 3 node(s)") != std::string::npos;
  }, 120)) << h[0]->err_so_far();
  std::this_thread::sleep_for(std::chrono::seconds(5));
  EXPECT_EQ(h[0]->err_so_far().find(": 1 node(s)"), std::string::npos)
      << "host 0 began a round alone: " << h[0]->err_so_far();

  hosts.set_link(0, true);
  const double healed_at = h[1]->elapsed_s();
  const size_t before = h[1]->err_so_far().size();
  double whole_at = -1;
  ASSERT_TRUE(testing::wait_until([&] {
    if (h[1]->err_so_far().find(": 3 node(s)", before) == std::string::npos) return false;
    whole_at = h[1]->elapsed_s();
    return true;
  }, 120)) << h[1]->err_so_far() << h[0]->err_so_far();
  std::printf("[ measured ] link back: the job ran on 3 nodes again %.1f s later\n",
              whole_at - healed_at);
  for (int k = 0; k < 3; ++k) {
    const Result& r = h[k]->wait();
    EXPECT_TRUE(r.exited(0)) << "host " << k << ": " << r.describe();
  }
  EXPECT_EQ(watch.stop(), "") << "two groups trained at once";
  EXPECT_EQ(h[0]->wait().err.find(": 1 node(s)"), std::string::npos) << h[0]->wait().err;
  expect_each_sample_once(dir_ / "run" / "samples");
  expect_one_lineage(dir_ / "run");
  for (int k = 0; k < 3; ++k) EXPECT_EQ(hosts.processes(k), 0);
}

// 4 hosts on two switches, {0 (the store's), 1} and {2, 3}, --nnodes 1:4: MIN lets any side
// begin a round, only the majority rule stops them. Cut in halves (2 | 2), neither has a
// majority of the 4 (3): nobody trains and each side waits, saying so; {2, 3} move the store to
// host 2 meanwhile. Joined again, the halves, in two stores, find each other at the endpoint and
// the job runs on 4. One lineage wrote into the run folder, and every sample of each epoch was
// trained once.
TEST_F(Elastic, HalvesWithoutAMajorityNeverTrainAndFindEachOtherWhenJoined) {
  Hosts hosts(4, 2);
  const std::vector<std::string> extra = {"--rdzv-conf", "last_call_timeout=1,join_timeout=120",
                                          "--collective-timeout", "15"};
  std::vector<std::optional<Subprocess>> h(4);
  for (int k = 0; k < 4; ++k) h[k].emplace(node(hosts, k, "1:4", train("run"), extra));
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  ASSERT_TRUE(testing::wait_until([&] {
    return h[0]->err_so_far().find("elastic round 0: 4 node(s)") != std::string::npos &&
           fs::exists(ckpts / "epoch=0-step=4.ckpt");
  }, 180)) << h[0]->err_so_far() << h[0]->out_so_far();
  auto errs = [&] {
    std::string all;
    for (auto& p : h) all += p->err_so_far();
    return all;
  };
  // What every rank has trained so far: the sample log's files and their sizes.
  auto trained = [&] {
    std::map<std::string, uintmax_t> files;
    for (const auto& e : fs::directory_iterator(dir_ / "run" / "samples")) {
      files[e.path().filename().string()] = fs::file_size(e.path());
    }
    return files;
  };

  GroupWatch watch(dir_ / "run" / "samples");
  hosts.set_split(true);
  const double cut_at = h[0]->elapsed_s();
  ASSERT_TRUE(testing::wait_until([&] {
    for (auto& p : h) {
      if (p->err_so_far().find("waits for a majority of the 4 node(s)") == std::string::npos) {
        return false;
      }
    }
    return true;
  }, 120)) << errs();
  std::printf("[ measured ] cut in halves: every node waited for a majority %.1f s after the cut\n",
              h[0]->elapsed_s() - cut_at);
  // Sampled for 5 s: no rank trains, no round begins.
  const auto during = trained();
  std::this_thread::sleep_for(std::chrono::seconds(5));
  EXPECT_EQ(trained(), during) << "a rank trained while the job was cut in halves";
  EXPECT_EQ(errs().find(": 2 node(s)"), std::string::npos) << "a half began a round: " << errs();
  EXPECT_NE(h[2]->err_so_far().find("it moved to"), std::string::npos) << h[2]->err_so_far();

  const size_t before = h[0]->err_so_far().size();
  hosts.set_split(false);
  const double joined_at = h[0]->elapsed_s();
  const double whole_at = when_said(*h[0], ": 4 node(s)", before, 120);
  ASSERT_GE(whole_at, 0) << errs();
  std::printf("[ measured ] halves joined again: the job ran on 4 nodes %.1f s later\n",
              whole_at - joined_at);
  EXPECT_NE(h[2]->err_so_far().find("moved from", 0), std::string::npos)
      << "host 2 went back to the endpoint's store: " << h[2]->err_so_far();

  for (int k = 0; k < 4; ++k) {
    const Result& r = h[k]->wait();
    EXPECT_TRUE(r.exited(0)) << "host " << k << ": " << r.describe();
  }
  EXPECT_EQ(watch.stop(), "") << "two groups trained at once";
  for (auto& p : h) {
    EXPECT_EQ(p->wait().err.find(": 2 node(s)"), std::string::npos) << p->wait().err;
    EXPECT_EQ(p->wait().err.find(": 1 node(s)"), std::string::npos) << p->wait().err;
  }
  expect_each_sample_once(dir_ / "run" / "samples");
  expect_one_lineage(dir_ / "run");
  for (int k = 0; k < 4; ++k) EXPECT_EQ(hosts.processes(k), 0);
}

// 4 hosts on two bridges, {0 (the store's), 1, 2} and {3}, --nnodes 1:4: host 3 cut off alone
// (3 | 1) for a minute. The three are a majority of the last round's 4 and go on at 3 nodes;
// host 3 waits, for MIN is 1 and only the majority rule keeps it from training alone into the
// same run folder. A minute after the cut the link is back: host 3 is admitted when the job next
// re-forms, and the job trains on 4 (then the test ends it). Watched throughout: at no look do
// two groups train.
TEST_F(Elastic, OneHostCutOffForAMinuteWaitsWhileTheThreeGoOnThenRejoins) {
  Hosts hosts(4, 3);
  const std::vector<std::string> extra = {"--rdzv-conf", "last_call_timeout=1,join_timeout=180",
                                          "--collective-timeout", "15"};
  // Long enough that the three still train when the minute is over: here they reach epoch 9 of
  // 20 by then, so a machine twice as fast still has the job running.
  constexpr int kLongEpochs = 20;
  std::vector<std::optional<Subprocess>> h(4);
  for (int k = 0; k < 4; ++k) h[k].emplace(node(hosts, k, "1:4", train("run", kLongEpochs), extra));
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  ASSERT_TRUE(testing::wait_until([&] {
    return h[0]->err_so_far().find("elastic round 0: 4 node(s)") != std::string::npos &&
           fs::exists(ckpts / "epoch=0-step=4.ckpt");
  }, 180)) << h[0]->err_so_far() << h[0]->out_so_far();
  auto errs = [&] {
    std::string all;
    for (auto& p : h) all += p->err_so_far();
    return all;
  };

  GroupWatch watch(dir_ / "run" / "samples");
  const size_t before0 = h[0]->err_so_far().size(), before3 = h[3]->err_so_far().size();
  hosts.set_split(true);
  const auto cut = std::chrono::steady_clock::now();
  const double cut_at = h[0]->elapsed_s();
  double reformed_at = -1, trained_at = -1;
  int64_t step_then = -1;
  ASSERT_TRUE(testing::wait_until([&] {
    if (reformed_at < 0 && h[0]->err_so_far().find(": 3 node(s)", before0) != std::string::npos) {
      reformed_at = h[0]->elapsed_s();
      step_then = newest_step(ckpts);
    }
    if (reformed_at >= 0 && newest_step(ckpts) > step_then) trained_at = h[0]->elapsed_s();
    return trained_at >= 0;
  }, 60)) << errs();
  std::printf("[ measured ] 3 | 1: the three re-formed %.1f s after the cut and checkpointed a new "
              "step %.1f s after it\n", reformed_at - cut_at, trained_at - cut_at);
  EXPECT_GE(when_said(*h[3], "waits for a majority of the 4 node(s)", before3,
                      60 - (h[0]->elapsed_s() - cut_at)), 0)
      << h[3]->err_so_far();
  std::this_thread::sleep_until(cut + std::chrono::seconds(60));
  EXPECT_EQ(h[3]->err_so_far().find(": 1 node(s)", before3), std::string::npos)
      << "host 3 began a round alone: " << h[3]->err_so_far();

  const size_t before = h[0]->err_so_far().size();
  hosts.set_split(false);
  const double healed_at = h[0]->elapsed_s();
  const double whole_at = when_said(*h[0], ": 4 node(s)", before, 120);
  ASSERT_GE(whole_at, 0) << "(if the three finished the job within the minute, raise kLongEpochs) "
                         << errs();
  std::printf("[ measured ] 3 | 1 healed after 60 s: the job ran on 4 nodes %.1f s later\n",
              whole_at - healed_at);
  // Once the 4 have trained a step, the test ends the job: its other epochs would run the same
  // 4 nodes (about 80 s here).
  end_now(hosts, h, ckpts, newest_step(ckpts));
  EXPECT_EQ(watch.stop(), "") << "two groups trained at once";
  EXPECT_EQ(h[3]->wait().err.find(": 1 node(s)"), std::string::npos) << h[3]->wait().err;
  expect_each_sample_once(dir_ / "run" / "samples", kLongEpochs, Ended::kKilled);
  expect_one_lineage(dir_ / "run", Ended::kKilled);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(hosts.processes(k), 0);
}

// The link between {0 (the store's), 1} and {2, 3} flaps while the job trains at --nnodes 1:4:
// down and up again every few seconds, each time down for longer than the 4 s collective timeout,
// so that the group fails, rounds form in the gaps and fail again at every stage of their
// start. Whatever the timing, each round that forms holds a majority of the one before it, no
// two groups train at once (watched every 200 ms), the run folder holds one lineage whose rounds
// only grow, and once the link stays up the job finishes on all 4 nodes with every sample of
// each epoch trained once.
TEST_F(Elastic, AFlappingLinkNeverMakesTwoGroupsAndTheJobFinishesWhole) {
  Hosts hosts(4, 2);
  const std::vector<std::string> extra = {"--rdzv-conf", "last_call_timeout=1,join_timeout=120",
                                          "--collective-timeout", "4", "--max-restarts", "30"};
  constexpr int kLongEpochs = 4;
  std::vector<std::optional<Subprocess>> h(4);
  for (int k = 0; k < 4; ++k) h[k].emplace(node(hosts, k, "1:4", train("run", kLongEpochs), extra));
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  ASSERT_TRUE(testing::wait_until([&] {
    return h[0]->err_so_far().find("elastic round 0: 4 node(s)") != std::string::npos &&
           fs::exists(ckpts / "epoch=0-step=4.ckpt");
  }, 180)) << h[0]->err_so_far() << h[0]->out_so_far();

  GroupWatch watch(dir_ / "run" / "samples");
  // Seconds down, then up: uneven, so that the cuts land on different stages of a round.
  // One cut is long enough for a round to close on a side, were it allowed to.
  const std::vector<std::pair<int, int>> flaps = {{6, 3}, {12, 4}, {5, 5}, {7, 2}, {8, 3}};
  for (const auto& [down, up] : flaps) {
    hosts.set_split(true);
    std::this_thread::sleep_for(std::chrono::seconds(down));
    hosts.set_split(false);
    std::this_thread::sleep_for(std::chrono::seconds(up));
  }
  // The rounds that formed, from every node's "elastic round R: N node(s) (...), node ranks A,
  // B, ...; ...", and each node's last.
  std::map<int, std::set<std::string>> rounds;
  std::string last_round;
  const std::regex formed(R"(elastic round (\d+): (\d+) node\(s\) \([^)]*\), node ranks ([^;]+);)");
  for (int k = 0; k < 4; ++k) {
    const Result& r = h[k]->wait();
    EXPECT_TRUE(r.exited(0)) << "host " << k << ": " << r.describe();
    std::string said = r.err, n;
    for (std::smatch m; std::regex_search(said, m, formed); said = m.suffix()) {
      std::set<std::string> nodes;
      std::istringstream ids(m[3]);
      for (std::string id; std::getline(ids >> std::ws, id, ',');) nodes.insert(id);
      const int round = std::stoi(m[1]);
      EXPECT_TRUE(rounds.count(round) == 0 || rounds[round] == nodes)
          << "round " << round << " formed twice, by different nodes";
      rounds[round] = nodes;
      n = m[2];
    }
    last_round += n + " ";
  }
  EXPECT_EQ(last_round, "4 4 4 4 ") << "each node's last round had that many nodes";
  // Note [Never two groups]: each round holds a majority of the one before it.
  std::string line;
  for (auto it = rounds.begin(); it != rounds.end(); ++it) {
    line += fmt::format(" {}:{}", it->first, it->second.size());
    if (it == rounds.begin()) continue;
    const auto& before = std::prev(it)->second;
    const auto held = std::ranges::count_if(it->second, [&](const std::string& id) {
      return before.count(id) > 0;
    });
    EXPECT_GT(2 * held, static_cast<int64_t>(before.size()))
        << "round " << it->first << " (" << fmt::format("{}", fmt::join(it->second, ", "))
        << ") holds no majority of round " << std::prev(it)->first << " ("
        << fmt::format("{}", fmt::join(before, ", ")) << ")";
  }
  std::printf("[ measured ] rounds formed (round:nodes):%s\n", line.c_str());
  EXPECT_EQ(watch.stop(), "") << "two groups trained at once";
  expect_each_sample_once(dir_ / "run" / "samples", kLongEpochs);
  expect_one_lineage(dir_ / "run");
  for (int k = 0; k < 4; ++k) EXPECT_EQ(hosts.processes(k), 0);
}

// --nnodes 2:3 on 4 hosts: the fourth waits, says why, and ends when the job finishes. The job
// ran at 3 nodes throughout, so its model is the one a fixed 3-node job trains.
TEST_F(Elastic, AHostOverMaxWaitsAndTheJobTrainsAsAFixedOne) {
  {
    Hosts hosts(3);
    std::vector<std::optional<Subprocess>> h(3);
    for (int k = 0; k < 3; ++k) {
      h[k].emplace(hosts.start(k, [&] {
        std::vector<std::string> argv = {kDdprun, "--nnodes", "3", "--node-rank", std::to_string(k),
                                         "--nproc-per-node", "2", "--master-addr", hosts.address(0),
                                         "--master-port", "29500"};
        for (const std::string& a : train("fixed")) argv.push_back(a);
        return argv;
      }(), {}, 300));
    }
    for (int k = 0; k < 3; ++k) {
      const Result& r = h[k]->wait();
      ASSERT_TRUE(r.exited(0)) << r.describe();
    }
  }
  Hosts hosts(4);
  std::vector<std::optional<Subprocess>> h(4);
  for (int k = 0; k < 3; ++k) h[k].emplace(node(hosts, k, "2:3", train("run")));
  ASSERT_TRUE(testing::wait_until([&] {
    return h[0]->err_so_far().find("elastic round 0: 3 node(s)") != std::string::npos;
  }, 120)) << h[0]->err_so_far();
  h[3].emplace(node(hosts, 3, "2:3", train("run")));
  for (int k = 0; k < 4; ++k) {
    const Result& r = h[k]->wait();
    EXPECT_TRUE(r.exited(0)) << "host " << k << ": " << r.describe();
  }
  const std::string err3 = h[3]->wait().err;
  EXPECT_NE(err3.find("it runs at its maximum"), std::string::npos) << err3;
  EXPECT_NE(err3.find("finished in round 0"), std::string::npos) << err3;
  EXPECT_EQ(h[0]->wait().err.find("re-form"), std::string::npos) << h[0]->wait().err;
  expect_each_sample_once(dir_ / "run" / "samples");
  expect_one_lineage(dir_ / "run");
  const auto fixed = testing::load_state(dir_ / "fixed" / "model_state.pt");
  const auto elastic = testing::load_state(dir_ / "run" / "model_state.pt");
  ASSERT_EQ(fixed.size(), elastic.size());
  for (const auto& [name, tensor] : fixed) {
    ASSERT_EQ(elastic.count(name), 1u) << name;
    EXPECT_TRUE(torch::equal(tensor, elastic.at(name))) << name;
  }
}

// 2 hosts, --nnodes 2:2 with a short join timeout: host 1 is killed and not started again. Host 0
// waits the join timeout for a second node, then fails naming host 1.
TEST_F(Elastic, FewerThanMinWaitsTheJoinTimeoutThenFailsNamingTheMissing) {
  Hosts hosts(2);
  std::vector<std::string> extra = {"--rdzv-conf", "last_call_timeout=1,join_timeout=8"};
  auto h0 = node(hosts, 0, "2:3", train("run"), extra);
  auto h1 = node(hosts, 1, "2:3", train("run"), extra);
  ASSERT_TRUE(testing::wait_until([&] {
    return fs::exists(dir_ / "run" / "checkpoints" / "epoch=0-step=2.ckpt");
  }, 180)) << h0.err_so_far() << h0.out_so_far();
  std::system(fmt::format("ip netns pids {} | xargs -r kill -9", hosts.host(1)).c_str());
  const double killed_at = h0.elapsed_s();
  const Result& r0 = h0.wait();
  EXPECT_EQ(r0.exit_code, 1) << r0.describe();
  EXPECT_NE(r0.err.find("fewer than the minimum of 2 (--nnodes 2:3)"), std::string::npos)
      << r0.describe();
  // Named with its node rank in the round it last ran in (ranks follow arrival there).
  EXPECT_NE(r0.err.find(fmt::format("missing: {} (node ", hosts.host(1))), std::string::npos)
      << r0.describe();
  EXPECT_NE(r0.err.find(" of round 0)"), std::string::npos) << r0.describe();
  EXPECT_LT(r0.wall_s - killed_at, 8 + 20) << "the join timeout and the teardown";
  EXPECT_EQ(hosts.processes(0), 0);
}

// --- --rdzv-backend etcd (Note [etcd backend] in tools/ddprun/etcd.h): a 3-member etcd cluster,
// one member on each of hosts 0, 1 and 2, started by the test (skipped without etcd-server).

// 4 hosts on two bridges, the etcd members on hosts 0, 1 (one side) and 2 (the other); the link
// between the sides cut while the job trains on 4 nodes. The side holding etcd's majority
// re-forms at 2 nodes and trains; hosts 2 and 3 reach only the minority member, which answers
// nothing, and never begin a round; after the heal the job grows back to 4 and trains (then the
// test ends it).
TEST_F(Elastic, OnEtcdTheSideWithTheClustersMajorityTrainsAndTheOtherWaits) {
  if (auto why = testing::EtcdCluster::unavailable()) GTEST_SKIP() << *why;
  Hosts hosts(4, 2);
  auto etcd = etcd_on(hosts, {0, 1, 2});
  ASSERT_TRUE(etcd->wait_healthy()) << etcd->log(0);
  const std::vector<std::string> extra = {"--rdzv-conf", "last_call_timeout=1,join_timeout=120",
                                          "--collective-timeout", "15"};
  // Long enough that the majority side still trains when the link is back.
  constexpr int kLongEpochs = 10;
  std::vector<std::optional<Subprocess>> h(4);
  for (int k = 0; k < 4; ++k) h[k].emplace(node(hosts, k, "2:4", train("run", kLongEpochs), extra));
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  ASSERT_TRUE(testing::wait_until([&] {
    return h[0]->err_so_far().find("elastic round 0: 4 node(s)") != std::string::npos &&
           fs::exists(ckpts / "epoch=0-step=4.ckpt");
  }, 180)) << h[0]->err_so_far() << h[0]->out_so_far();
  auto errs = [&] {
    std::string all;
    for (auto& p : h) all += p->err_so_far();
    return all;
  };

  const size_t before2 = h[2]->err_so_far().size(), before3 = h[3]->err_so_far().size();
  const size_t before0 = h[0]->err_so_far().size();
  GroupWatch watch(dir_ / "run" / "samples");
  hosts.set_split(true);
  const double cut_at = h[0]->elapsed_s();
  double reformed_at = -1, trained_at = -1;
  int64_t step_then = -1;
  ASSERT_TRUE(testing::wait_until([&] {
    if (reformed_at < 0 && h[0]->err_so_far().find(": 2 node(s)", before0) != std::string::npos) {
      reformed_at = h[0]->elapsed_s();
      step_then = newest_step(ckpts);
    }
    // Training again: a checkpoint newer than any from before the round.
    if (reformed_at >= 0 && newest_step(ckpts) > step_then) trained_at = h[0]->elapsed_s();
    return trained_at >= 0;
  }, 120)) << errs();
  std::printf("[ measured ] etcd, cut 2|2: the side with etcd's majority re-formed on 2 nodes "
              "%.1f s after the cut and checkpointed a new step %.1f s after it\n",
              reformed_at - cut_at, trained_at - cut_at);
  // Sampled for 5 s: the other side begins no round.
  std::this_thread::sleep_for(std::chrono::seconds(5));
  EXPECT_EQ(h[2]->err_so_far().find("node(s)", before2), std::string::npos) << h[2]->err_so_far();
  EXPECT_EQ(h[3]->err_so_far().find("node(s)", before3), std::string::npos) << h[3]->err_so_far();

  const size_t before = h[0]->err_so_far().size();
  hosts.set_split(false);
  const double joined_at = h[0]->elapsed_s();
  const double whole_at = when_said(*h[0], ": 4 node(s)", before, 150);
  ASSERT_GE(whole_at, 0) << errs();
  std::printf("[ measured ] etcd: healed, the job ran on 4 nodes %.1f s later\n",
              whole_at - joined_at);
  // Once the 4 have trained a step, the test ends the job (etcd's members with it).
  end_now(hosts, h, ckpts, newest_step(ckpts));
  EXPECT_EQ(watch.stop(), "") << "two groups trained at once";
  for (int k : {2, 3}) {
    const std::string& err = h[k]->wait().err;
    EXPECT_EQ(err.find(": 2 node(s)"), std::string::npos) << err;
    EXPECT_EQ(err.find(": 1 node(s)"), std::string::npos) << err;
  }
  expect_each_sample_once(dir_ / "run" / "samples", kLongEpochs, Ended::kKilled);
  expect_one_lineage(dir_ / "run", Ended::kKilled);
  etcd.reset();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(hosts.processes(k), 0);
}

// 3 hosts, each with a member: the host of etcd's leader is lost whole (its etcd member, its
// ddprun, its workers). The other two elect a leader, re-form at 2 nodes and finish.
TEST_F(Elastic, OnEtcdTheLeadersHostLostCostsARoundNotTheJob) {
  if (auto why = testing::EtcdCluster::unavailable()) GTEST_SKIP() << *why;
  Hosts hosts(3);
  auto etcd = etcd_on(hosts, {0, 1, 2});
  ASSERT_TRUE(etcd->wait_healthy()) << etcd->log(0);
  std::vector<std::optional<Subprocess>> h(3);
  for (int k = 0; k < 3; ++k) h[k].emplace(node(hosts, k, "2:3", train("run")));
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  ASSERT_TRUE(testing::wait_until([&] {
    return h[0]->err_so_far().find("elastic round 0: 3 node(s)") != std::string::npos &&
           fs::exists(ckpts / "epoch=0-step=4.ckpt");
  }, 180)) << h[0]->err_so_far() << h[0]->out_so_far();
  // The leader, as member 0 sees it: its id against each member's own.
  const std::regex leader_of(R"re("leader":"(\d+)")re"), member_of(R"re("member_id":"(\d+)")re");
  int leader = -1;
  std::smatch m;
  const std::string status0 = ask_etcd(hosts, 0, "/v3/maintenance/status", "{}");
  ASSERT_TRUE(std::regex_search(status0, m, leader_of)) << status0;
  const std::string leader_id = m[1];
  for (int k = 0; k < 3; ++k) {
    const std::string status = ask_etcd(hosts, k, "/v3/maintenance/status", "{}");
    if (std::regex_search(status, m, member_of) && m[1] == leader_id) leader = k;
  }
  ASSERT_GE(leader, 0) << status0;
  const int other = leader == 0 ? 1 : 0;
  const size_t before = h[other]->err_so_far().size();
  std::system(fmt::format("ip netns pids {} | xargs -r kill -9", hosts.host(leader)).c_str());
  const double killed_at = h[other]->elapsed_s();
  h[leader]->wait();
  const double reformed_at = when_said(*h[other], ": 2 node(s)", before, 90);
  ASSERT_GE(reformed_at, 0) << h[other]->err_so_far();
  std::printf("[ measured ] etcd: the leader's host (host %d) killed: the 2 survivors re-formed "
              "%.1f s later\n", leader, reformed_at - killed_at);
  for (int k = 0; k < 3; ++k) {
    if (k == leader) continue;
    const Result& r = h[k]->wait();
    EXPECT_TRUE(r.exited(0)) << "host " << k << ": " << r.describe();
  }
  expect_each_sample_once(dir_ / "run" / "samples");
  expect_one_lineage(dir_ / "run");
}

// Every etcd member stopped (SIGSTOP) for 5 s, longer than the ddprun leases (3 s), while 2 hosts
// train: the workers do not need etcd while they run, so the job trains on, in its first round,
// and finishes; the nodes' signs of life come back with new leases.
TEST_F(Elastic, OnEtcdAllOfEtcdGoneLongerThanTheLeasesCostsNothing) {
  if (auto why = testing::EtcdCluster::unavailable()) GTEST_SKIP() << *why;
  Hosts hosts(3);
  auto etcd = etcd_on(hosts, {0, 1, 2});
  ASSERT_TRUE(etcd->wait_healthy()) << etcd->log(0);
  // Still training when etcd comes back: etcd stops at step 4 or later of 72 (3 epochs of 24
  // steps at 4 ranks), and the job had reached step 28 when it came back, here.
  constexpr int kLongEpochs = 3;
  std::vector<std::optional<Subprocess>> h(2);
  for (int k = 0; k < 2; ++k) h[k].emplace(node(hosts, k, "2:2", train("run", kLongEpochs)));
  const fs::path ckpts = dir_ / "run" / "checkpoints";
  ASSERT_TRUE(testing::wait_until([&] {
    return fs::exists(ckpts / "epoch=0-step=4.ckpt");
  }, 180)) << h[0]->err_so_far() << h[0]->out_so_far();
  for (int k = 0; k < 3; ++k) etcd->signal(k, SIGSTOP);
  const int64_t step_then = newest_step(ckpts);
  std::this_thread::sleep_for(std::chrono::seconds(5));
  const int64_t step_after = newest_step(ckpts);
  EXPECT_GT(step_after, step_then) << "the workers trained on while etcd was gone";
  std::printf("[ measured ] etcd stopped for 5 s: the job checkpointed steps %ld to %ld meanwhile "
              "(of %d)\n", static_cast<long>(step_then), static_cast<long>(step_after),
              kLongEpochs * kSamples / (32 * 4));
  for (int k = 0; k < 3; ++k) etcd->signal(k, SIGCONT);
  for (int k = 0; k < 2; ++k) {
    const Result& r = h[k]->wait();
    EXPECT_TRUE(r.exited(0)) << "host " << k << ": " << r.describe();
    EXPECT_EQ(r.err.find("elastic round 1"), std::string::npos) << r.err;
  }
  expect_each_sample_once(dir_ / "run" / "samples", kLongEpochs);
  expect_one_lineage(dir_ / "run");
}

}  // namespace
}  // namespace ddp
// clang-format on
