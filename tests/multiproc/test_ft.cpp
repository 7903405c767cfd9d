// Per-step fault tolerance in real processes (Note [Per-step fault tolerance] in
// ddp/fault_tolerance.h): ddprun --ft with examples/ft_train, and with ddp-train --ft (Note
// [Training under ft::Manager] in tools/ddp_train/ft_loop.cpp). Two workers SIGKILLed in one step
// cost the others the step in flight: they stay up, ddprun starts each killed one again alone, and
// they are healed live from the others' state; one SIGSTOPped is dropped, and healed when it wakes;
// one SIGKILLed inside its optimizer's step, after its commit vote, leaves that step committed by
// the others and in its replacement's state; a healer killed while it sends its state leaves the
// others to heal in the next quorum. Every replica that finishes ends bitwise equal to the others
// and, to float tolerance, to one process trained on the same global batches; every step is
// committed once. Every replica lost at once, the restarted ones refuse to train from step 0. With
// its restarts spent, the job fails and says so. ddp-train --ft loses a step, not the run, when a
// replica is killed, also when it is rank 0 caught writing a checkpoint: every checkpoint left is
// whole.
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/checkpoint.h"
#include "support/ft_steps.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Committed;
using testing::committed;
using testing::Result;
using testing::Subprocess;
using testing::unix_ms;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kFtTrain = testing::env_or_die("EXAMPLE_FT_TRAIN");
const std::string kDdpTrain = testing::env_or_die("DDP_TRAIN");
const std::string kFtFaults = testing::env_or_die("FT_FAULTS");  // tests/multiproc/ft_faults.cpp

// The workers ddprun started (its children), in pid order.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    const size_t close = line.rfind(')');
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(std::stoi(name));
  }
  std::sort(out.begin(), out.end());
  return out;
}

class FtJob : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_temp_dir("ddp_ft"); }
  void TearDown() override { fs::remove_all(dir_); }

  Subprocess job(int nproc, int max_restarts, const fs::path& out, int steps, int step_ms,
                 int collective_timeout_s = 20) {
    return Subprocess::start(
        {.argv = {kDdprun, "--ft", "--standalone", "--nproc-per-node", std::to_string(nproc),
                  "--max-restarts", std::to_string(max_restarts), "--collective-timeout",
                  std::to_string(collective_timeout_s), kFtTrain, "--steps", std::to_string(steps),
                  "--out", out.string(), "--step-ms", std::to_string(step_ms)},
         .timeout_s = 240});
  }

  // Waits until ddprun's workers (nproc of them) have committed `step`; returns them.
  std::vector<pid_t> workers_past(Subprocess& p, int nproc, const fs::path& out, int64_t step) {
    std::vector<pid_t> w;
    testing::wait_until(
        [&] {
          w = children_of(p.pid());
          if (static_cast<int>(w.size()) != nproc || !fs::exists(out)) return false;
          for (const auto& [file, steps] : committed(out)) {
            if (!steps.empty() && steps.back().step >= step) return true;
          }
          return false;
        },
        120);
    return w;
  }

  fs::path dir_;
};

constexpr int kSteps = 300;

// One process on the same batches (reference() below).
std::vector<at::Tensor> run_reference(const fs::path& dir) {
  Subprocess p = Subprocess::start(
      {.argv = {kDdprun, "--ft", "--standalone", "--nproc-per-node", "1", kFtTrain, "--steps",
                std::to_string(kSteps), "--out", (dir / "one").string()},
       .timeout_s = 120});
  const Result& r = p.wait();
  EXPECT_TRUE(r.exited(0)) << r.describe();
  for (const auto& e : fs::directory_iterator(dir / "one")) {
    if (e.path().filename().string().starts_with("final.")) return testing::load_params(e.path());
  }
  ADD_FAILURE() << "no final parameters from the one-process run";
  return {};
}

// One process on the same batches: what every replica must end with. Run once per test program
// (every case trains the same kSteps batches); a failed run is tried again by the next case.
std::vector<at::Tensor> reference(const fs::path& dir) {
  static std::vector<at::Tensor> one;
  if (one.empty()) one = run_reference(dir);
  return one;
}

// ddprun --ft's line for each of the first `restarts` workers it started again alone, of
// `budget` (--max-restarts).
void expect_restarted_alone(const std::string& err, int restarts, int budget) {
  for (int k = 1; k <= restarts; ++k) {
    EXPECT_NE(err.find(
                  fmt::format("starting it again alone, the others go on (--ft: restart {} of {})",
                              k, budget)),
              std::string::npos)
        << err;
  }
}

// The final parameters in `out`: `replicas` of them, bitwise equal to each other and, to float
// tolerance, to one process on the same batches (reference(), run in `dir`).
void expect_finals_equal_to_one_process(const fs::path& out, size_t replicas, const fs::path& dir) {
  const std::vector<std::vector<at::Tensor>> all = testing::finals(out);
  ASSERT_EQ(all.size(), replicas);
  testing::expect_bitwise_equal(all);
  testing::expect_close_to_one_process(all[0], reference(dir));
}

// 4 workers; the second and the fourth are SIGKILLed together mid-training (two failures in one
// step). The other two lose one step, ddprun starts each killed one again alone, they are
// healed, and all four finish the 300 steps: the survivors and the healed bitwise equal, and
// equal to one process to float tolerance.
TEST_F(FtJob, TwoWorkersKilledInOneStepCostOneStepAndAreHealedLive) {
  const fs::path out = dir_ / "run";
  Subprocess p = job(4, 4, out, kSteps, 10);
  const std::vector<pid_t> workers = workers_past(p, 4, out, 60);
  ASSERT_EQ(workers.size(), 4u) << p.err_so_far();
  const int64_t killed_at = unix_ms();
  ASSERT_EQ(::kill(workers[1], SIGKILL), 0);
  ASSERT_EQ(::kill(workers[3], SIGKILL), 0);
  const Result& r = p.wait();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  expect_restarted_alone(r.err, 2, 4);
  EXPECT_NE(r.out.find("(healed)"), std::string::npos) << r.out;

  // Every replica: steps committed once each, in order; the survivors' first step after the
  // kill, and how long it took.
  const auto all = committed(out);
  const std::set<std::string> victims = {fmt::format("steps.pid{}.txt", workers[1]),
                                         fmt::format("steps.pid{}.txt", workers[3])};
  int finished = 0;
  double recovered_s = -1;
  for (const auto& [file, steps] : all) {
    for (size_t i = 1; i < steps.size(); ++i) {
      EXPECT_EQ(steps[i].step, steps[i - 1].step + 1) << file << ": a step twice or skipped";
    }
    if (steps.empty() || steps.back().step != kSteps - 1) continue;
    ++finished;
    if (victims.contains(file) || steps.front().step != 0) continue;  // the healed
    const std::vector<int> sizes = testing::sizes_of(steps);
    EXPECT_EQ(sizes.back(), 4) << file << ": the group grew back";
    std::printf("[ measured ] %s trained at %s replica(s)\n", file.c_str(),
                fmt::format("{}", fmt::join(sizes, ", ")).c_str());
    for (const Committed& c : steps) {
      if (c.at_ms > killed_at) {
        recovered_s = std::max(recovered_s, (c.at_ms - killed_at) / 1000.0);
        break;
      }
    }
  }
  EXPECT_EQ(finished, 4) << "two survivors and the two healed replicas";
  ASSERT_GE(recovered_s, 0);
  std::printf(
      "[ measured ] two workers SIGKILLed: the survivors committed their next step %.2f s "
      "later\n",
      recovered_s);

  expect_finals_equal_to_one_process(out, 4, dir_);
}

// A worker SIGKILLed inside its optimizer's step (tests/multiproc/ft_faults.cpp, preloaded
// into the unchanged ft_train): it had voted to commit, so the others commit that
// step and apply it; what it applied dies with it. The others lose the next step (the dead peer
// fails its all-reduce), never the one it died in, and never log a step twice; ddprun starts it
// again, it is healed with the committed step in its state, and all three end bitwise equal,
// and equal to one process to float tolerance: no replica kept or lost half a step.
TEST_F(FtJob, AWorkerKilledInsideItsOptimizerStepLeavesTheStepItVotedForCommitted) {
  const fs::path out = dir_ / "run", marker = dir_ / "died";
  constexpr int kDieAt = 60;  // its 60th call of SGD::step: the 60th step it committed
  Subprocess p = Subprocess::start(
      {.argv = {kDdprun, "--ft", "--standalone", "--nproc-per-node", "3", "--max-restarts", "3",
                "--collective-timeout", "20", "/usr/bin/env", "LD_PRELOAD=" + kFtFaults,
                fmt::format("DDP_TEST_DIE_IN_OPTIMIZER_STEP={}:{}", kDieAt, marker.string()),
                kFtTrain, "--steps", std::to_string(kSteps), "--out", out.string(), "--step-ms",
                "10"},
       .timeout_s = 240});
  const Result& r = p.wait();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  ASSERT_TRUE(fs::exists(marker)) << "no worker died in its optimizer step\n" << r.err;
  pid_t victim = 0;
  std::ifstream(marker) >> victim;
  ASSERT_GT(victim, 0);
  expect_restarted_alone(r.err, 1, 3);
  EXPECT_NE(r.out.find("(healed)"), std::string::npos) << r.out;

  const auto all = committed(out);
  const auto dead = all.find(fmt::format("steps.pid{}.txt", victim));
  ASSERT_NE(dead, all.end()) << "the victim logged no step";
  ASSERT_EQ(static_cast<int>(dead->second.size()), kDieAt - 1)
      << "it logged each step before the one it died in";
  const int64_t died_in = dead->second.back().step + 1;
  int survivors = 0, finished = 0;
  for (const auto& [file, steps] : all) {
    for (size_t i = 1; i < steps.size(); ++i) {
      EXPECT_GT(steps[i].step, steps[i - 1].step) << file << ": a step twice";
    }
    if (!steps.empty() && steps.back().step == kSteps - 1) ++finished;
    if (file == dead->first || steps.empty() || steps.front().step != 0) continue;
    ++survivors;
    const auto at = std::find_if(steps.begin(), steps.end(),
                                 [&](const Committed& c) { return c.step == died_in; });
    ASSERT_NE(at, steps.end()) << file << ": step " << died_in << ", voted for, not committed";
    EXPECT_EQ(at->replicas, 3) << file << ": committed by the three that voted";
    // The replica counts it trained at from there, in order.
    const std::vector<int> sizes = testing::sizes_of({at, steps.end()});
    EXPECT_EQ(sizes.back(), 3) << file << ": the group grew back";
    std::printf("[ measured ] %s: step %ld (the one it died in) and on at %s replica(s)\n",
                file.c_str(), static_cast<long>(died_in),
                fmt::format("{}", fmt::join(sizes, ", ")).c_str());
  }
  EXPECT_EQ(survivors, 2);
  EXPECT_EQ(finished, 3) << "two survivors and the healed replacement";

  expect_finals_equal_to_one_process(out, 3, dir_);
}

// The healer SIGKILLed while it sends its state (tests/multiproc/ft_faults.cpp): one of three
// workers is SIGKILLed mid-training; when ddprun has started it again, the quorum that takes it
// back has a survivor send it the state, and that survivor dies entering the broadcast of the
// state's bytes, after their size. The receiver restores nothing, the formation fails on every
// member, and the next quorum has the other survivor heal. Two restarts, nobody trains from a
// partial state, and all three end bitwise equal, and equal to one process to float tolerance.
// (Before, the healing's CollectiveError reached the program: the other survivor died too, and
// with every replica holding the newest step gone, the job ended.)
TEST_F(FtJob, AHealerKilledWhileItSendsItsStateLeavesTheOthersToHeal) {
  const fs::path out = dir_ / "run", marker = dir_ / "healer";
  Subprocess p = Subprocess::start(
      {.argv = {kDdprun, "--ft", "--standalone", "--nproc-per-node", "3", "--max-restarts", "3",
                "--collective-timeout", "20", "/usr/bin/env", "LD_PRELOAD=" + kFtFaults,
                "DDP_TEST_DIE_WHILE_HEALING=" + marker.string(), kFtTrain, "--steps",
                std::to_string(kSteps), "--out", out.string(), "--step-ms", "10"},
       .timeout_s = 240});
  const std::vector<pid_t> workers = workers_past(p, 3, out, 60);
  ASSERT_EQ(workers.size(), 3u) << p.err_so_far();
  ASSERT_EQ(::kill(workers[2], SIGKILL), 0);
  const Result& r = p.wait();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  ASSERT_TRUE(fs::exists(marker)) << "no healer died sending its state\n" << r.err;
  pid_t healer = 0;
  std::ifstream(marker) >> healer;
  EXPECT_TRUE(healer == workers[0] || healer == workers[1])
      << "the healer, pid " << healer << ", is a survivor of the first kill";
  expect_restarted_alone(r.err, 2, 3);
  const std::string said = r.out + r.err;
  EXPECT_NE(said.find("group did not form or heal"), std::string::npos) << said;
  EXPECT_NE(r.out.find("(healed)"), std::string::npos) << r.out;

  int finished = 0;
  for (const auto& [file, steps] : committed(out)) {
    for (size_t i = 1; i < steps.size(); ++i) {
      EXPECT_GT(steps[i].step, steps[i - 1].step) << file << ": a step twice";
    }
    if (!steps.empty() && steps.back().step == kSteps - 1) ++finished;
  }
  EXPECT_EQ(finished, 3) << "the survivor and the two healed";
  expect_finals_equal_to_one_process(out, 3, dir_);
}

// A worker SIGSTOPped for 8 s (a debugger, a swapped-out VM), past the 3 s collective timeout:
// the others drop the step it stalls, wait quorum_timeout for it, re-form without it and go on.
// Woken, it finds its group gone, arrives in a later quorum, and is healed: it never goes on
// with its stale state. Nobody was restarted. The one stopped is the quorum's rank 0: the case
// that failed in 2 runs of 10 while rank 0 hosted the quorum's group store (stopped, it froze
// the others' hang reports for seconds, until it woke and rejoined unhealed); every group now
// meets in ddprun's store.
TEST_F(FtJob, AStoppedWorkerIsDroppedThenHealedWhenItWakes) {
  const fs::path out = dir_ / "run";
  // Long enough that the others still train when it wakes.
  constexpr int kLongSteps = 1200;  // at most ~100 steps/s (--step-ms 10): 8 s are < 900
  Subprocess p = job(3, 3, out, kLongSteps, 10, 3);
  const std::vector<pid_t> workers = workers_past(p, 3, out, 60);
  ASSERT_EQ(workers.size(), 3u) << p.err_so_far();
  pid_t rank0 = 0;
  for (const auto& [file, steps] : committed(out)) {
    if (!steps.empty() && steps.back().rank == 0) rank0 = std::stoi(file.substr(9));
  }
  ASSERT_NE(std::find(workers.begin(), workers.end(), rank0), workers.end())
      << "no worker is rank 0 of the quorum";
  ASSERT_EQ(::kill(rank0, SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  {
    std::ifstream st(fmt::format("/proc/{}/stat", rank0));
    std::string line;
    std::getline(st, line);
    std::printf("[ measured ] stopped pid %d (the quorum's rank 0): %s\n", rank0,
                line.substr(0, 60).c_str());
  }
  std::this_thread::sleep_for(std::chrono::seconds(8));
  ASSERT_EQ(::kill(rank0, SIGCONT), 0);
  const Result& r = p.wait();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_EQ(r.err.find("starting it again"), std::string::npos) << "nobody restarted: " << r.err;
  EXPECT_NE(r.out.find("(healed)"), std::string::npos) << r.out;
  const std::vector<std::vector<at::Tensor>> finals = testing::finals(out);
  ASSERT_EQ(finals.size(), 3u);
  testing::expect_bitwise_equal(finals);
  for (const auto& [file, steps] : committed(out)) {
    // The stopped one jumps ahead once, when it is healed; no step is committed twice.
    for (size_t i = 1; i < steps.size(); ++i) EXPECT_GT(steps[i].step, steps[i - 1].step) << file;
    const std::vector<int> sizes = testing::sizes_of(steps);
    EXPECT_EQ(steps.back().step, kLongSteps - 1) << file;
    EXPECT_EQ(sizes.back(), 3) << file << ": the stopped one healed, the group whole again";
    std::printf("[ measured ] %s: steps %ld-%ld at %s replica(s)\n", file.c_str(),
                static_cast<long>(steps.front().step), static_cast<long>(steps.back().step),
                fmt::format("{}", fmt::join(sizes, ", ")).c_str());
  }
}

// Every replica lost at once (the job's one host, here both workers SIGKILLed): the ones ddprun
// starts again hold step 0 while the job committed past 60. Their quorum never trains from
// scratch into the job's output; each says the replicas that held the state are gone and to
// resume from a checkpoint, until the restarts are spent. (Sabotage: with the per-step record
// of the committed step off, the restarted pair trained 300 steps again from step 0.)
TEST_F(FtJob, EveryReplicaLostTheRestartedRefuseToTrainFromScratch) {
  const fs::path out = dir_ / "run";
  Subprocess p = job(2, 2, out, kSteps, 10);
  const std::vector<pid_t> workers = workers_past(p, 2, out, 60);
  ASSERT_EQ(workers.size(), 2u) << p.err_so_far();
  ASSERT_EQ(::kill(workers[0], SIGKILL), 0);
  ASSERT_EQ(::kill(workers[1], SIGKILL), 0);
  const Result& r = p.wait();
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.err.find("but the job committed step"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("every replica that held it is gone. Going on would train from an older "
                       "state; resume the job from its last checkpoint instead"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("are spent: the job fails"), std::string::npos) << r.err;
  EXPECT_LT(r.wall_s, 120);
  // No step was committed again: each step file is the killed workers', in order.
  for (const auto& [file, steps] : committed(out)) {
    EXPECT_TRUE(file == fmt::format("steps.pid{}.txt", workers[0]) ||
                file == fmt::format("steps.pid{}.txt", workers[1]))
        << file << ": a restarted replica committed " << steps.size() << " step(s) from "
        << (steps.empty() ? -1 : steps.front().step);
  }
}

// ddp-train --ft's sample log (Note [Sample log] in tools/ddp_train/run.h): "<epoch> <step>
// <replicas> <index>..." per step attempted, a file per replica, written before the step's vote.
struct LoggedStep {
  int64_t epoch, step;
  int replicas;
  std::vector<int64_t> indices;
};
// Each replica's steps; a step attempted again replaces its earlier line.
std::map<std::string, std::map<int64_t, LoggedStep>> sample_logs(const fs::path& dir) {
  std::map<std::string, std::map<int64_t, LoggedStep>> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream in(e.path());
    for (std::string line; std::getline(in, line);) {
      std::istringstream fields(line);
      LoggedStep s;
      fields >> s.epoch >> s.step >> s.replicas;
      for (int64_t i; fields >> i;) s.indices.push_back(i);
      out[e.path().filename().string()][s.step] = std::move(s);
    }
  }
  return out;
}

// The committed lines: a step's are those at the size of the replicas that went on past it (or,
// for the last step, of the replica that logged the most steps); a replica killed in a step the
// others dropped logged it at the old size. Also returns each step's size.
std::vector<LoggedStep> committed_lines(
    const std::map<std::string, std::map<int64_t, LoggedStep>>& logs,
    std::map<int64_t, int>& size_of) {
  size_t longest = 0;
  std::string survivor;
  for (const auto& [file, steps] : logs) {
    if (steps.size() > longest) longest = steps.size(), survivor = file;
  }
  for (const auto& [file, steps] : logs) {
    for (const auto& [step, s] : steps) {
      if (steps.rbegin()->first == step) continue;  // nobody is known to have gone past it here
      const auto [it, fresh] = size_of.emplace(step, s.replicas);
      EXPECT_TRUE(fresh || it->second == s.replicas)
          << "step " << step << " went on at " << it->second << " and at " << s.replicas;
    }
  }
  for (const auto& [step, s] : logs.at(survivor)) size_of.emplace(step, s.replicas);
  std::vector<LoggedStep> out;
  for (const auto& [file, steps] : logs) {
    for (const auto& [step, s] : steps) {
      if (size_of.at(step) == s.replicas) out.push_back(s);
    }
  }
  return out;
}

// ddprun --ft with 3 replicas of ddp-train --ft: an MLP on `images` Fashion-MNIST images for
// `epochs` epochs, a checkpoint every `checkpoint_every` steps, sample logs in `samples`.
std::vector<std::string> ddp_train_ft(const fs::path& out, const fs::path& samples, int64_t images,
                                      int64_t epochs, int checkpoint_every) {
  std::vector<std::string> argv = {kDdprun};
  argv.insert(argv.end(), {"--ft", "--standalone", "--nproc-per-node", "3", "--max-restarts", "2",
                           "--collective-timeout", "20", kDdpTrain, "--ft", "--model", "mlp"});
  argv.insert(argv.end(),
              {"--workers", "0", "--threads", "1", "--batch-size", "16", "--test-subset", "1000",
               "--log-every", "100", "--checkpoint-every", std::to_string(checkpoint_every),
               "--no-plots", "--epochs", std::to_string(epochs)});
  argv.insert(argv.end(), {"--train-subset", std::to_string(images), "--output-dir", out.string(),
                           "--sample-log", samples.string()});
  return argv;
}

// What a ddp-train --ft run that lost one replica and healed it must show: it went on at 2
// replicas, said the step it dropped was not committed, read no checkpoint and ended with a model
// of normal accuracy; every step from 1 to the last committed at one size, the last at 3; one
// replica's first step the job's next one (healed, not trained from step 1); every image of every
// epoch trained once (a resplit pads at most replicas - 1 images).
void expect_a_run_that_lost_a_step_not_the_run(const Result& r, const fs::path& out,
                                               const fs::path& samples, int64_t images,
                                               int64_t epochs) {
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("starting it again alone, the others go on (--ft: restart 1 of 2)"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("not committed"), std::string::npos) << all;
  EXPECT_NE(all.find(": 2 replicas, step "), std::string::npos) << all;
  EXPECT_NE(all.find(" samples/s"), std::string::npos) << "each epoch's throughput: " << all;
  EXPECT_EQ(all.find("resumed from"), std::string::npos) << "no checkpoint is read: " << all;
  EXPECT_TRUE(fs::exists(out / "model_state.pt"));
  const size_t done = all.find("done: test accuracy ");
  ASSERT_NE(done, std::string::npos) << all;
  EXPECT_GT(std::stod(all.substr(done + 20)), 70.0) << all.substr(done, 200);

  const auto logs = sample_logs(samples);
  EXPECT_EQ(logs.size(), 4u) << "three replicas and the one started again";
  std::map<int64_t, int> size_of;
  const std::vector<LoggedStep> lines = committed_lines(logs, size_of);
  ASSERT_FALSE(size_of.empty());
  const int64_t last = size_of.rbegin()->first;
  EXPECT_EQ(size_of.begin()->first, 1);
  EXPECT_EQ(static_cast<int64_t>(size_of.size()), last) << "a step missing";
  EXPECT_EQ(size_of.at(last), 3) << "the job ends at 3 replicas";
  bool at_two = false, healed = false;
  for (const auto& [step, size] : size_of) at_two |= size == 2;
  EXPECT_TRUE(at_two) << "the survivors went on at 2";
  for (const auto& [file, steps] : logs) {
    if (steps.begin()->first > 1 && steps.rbegin()->first == last) healed = true;
  }
  EXPECT_TRUE(healed) << "a replica whose first step is the job's next one";

  for (int64_t e = 0; e < epochs; ++e) {
    std::vector<int> seen(images, 0);
    for (const LoggedStep& s : lines) {
      if (s.epoch != e) continue;
      for (int64_t i : s.indices) ++seen[i];
    }
    int64_t missing = 0, repeats = 0;
    for (int n : seen) {
      missing += n == 0;
      repeats += n > 1 ? n - 1 : 0;
    }
    EXPECT_EQ(missing, 0) << "epoch " << e;
    EXPECT_LE(repeats, 2 * 4) << "epoch " << e << ": more repeats than the resplits' padding";
  }
}

// ddp-train --ft, the main job under per-step fault tolerance: 3 replicas train an MLP on 12,000
// Fashion-MNIST images for 4 epochs; one is SIGKILLed mid-training. The other two drop the step
// in flight and go on at 2 (the rest of the epoch resplit between them); ddprun starts the
// killed one again, it is healed live (its first step is the job's next, not step 1) and the
// job ends at 3 replicas with a model of normal accuracy. No checkpoint was read. Every step is
// committed at one size, and every image of every epoch is trained once.
TEST_F(FtJob, DdpTrainLosesAStepNotTheRunWhenAReplicaIsKilled) {
  const fs::path out = dir_ / "run", samples = dir_ / "samples";
  constexpr int64_t kImages = 12000, kEpochs = 4;
  Subprocess p = Subprocess::start(
      {.argv = ddp_train_ft(out, samples, kImages, kEpochs, 100), .timeout_s = 300});
  std::vector<pid_t> workers;
  testing::wait_until(
      [&] {
        workers = children_of(p.pid());
        for (const auto& [file, steps] : sample_logs(samples)) {
          if (!steps.empty() && steps.rbegin()->first >= 60) return workers.size() == 3;
        }
        return false;
      },
      120);
  ASSERT_EQ(workers.size(), 3u) << p.err_so_far();
  ASSERT_EQ(::kill(workers[1], SIGKILL), 0);
  const Result& r = p.wait();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  expect_a_run_that_lost_a_step_not_the_run(r, out, samples, kImages, kEpochs);
}

// The replica writing a checkpoint (rank 0: the only writer) caught with its temporary in the
// checkpoint folder, before its rename, found by inotify as the file is created and frozen there
// (SIGSTOP; a writer that renamed already is let go and the next one tried), then SIGKILLed. Its
// unfinished file never becomes a checkpoint: the others drop the step, re-form at 2 (a new rank 0
// takes the run folder's lease) and go on; the replacement is healed; later checkpoints are
// written by the new rank 0, which removes the dead writer's temporary. Every checkpoint left
// verifies (checksums, format), one is newer than the kill, and the run is whole as above.
TEST_F(FtJob, DdpTrainRankZeroKilledMidCheckpointWriteLeavesEveryCheckpointWhole) {
  const fs::path out = dir_ / "run", samples = dir_ / "samples", ckpts = out / "checkpoints";
  constexpr int64_t kImages = 6000, kEpochs = 3;
  Subprocess p = Subprocess::start(
      {.argv = ddp_train_ft(out, samples, kImages, kEpochs, 10), .timeout_s = 300});
  testing::wait_until([&] { return fs::exists(ckpts) && children_of(p.pid()).size() == 3; }, 120);
  ASSERT_TRUE(fs::exists(ckpts)) << p.err_so_far();

  const int watch = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  ASSERT_GE(watch, 0) << std::strerror(errno);
  ASSERT_GE(::inotify_add_watch(watch, ckpts.c_str(), IN_CREATE), 0) << std::strerror(errno);
  pid_t killed = 0;
  std::string temp;
  int late = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!killed && std::chrono::steady_clock::now() < deadline) {
    pollfd pfd{.fd = watch, .events = POLLIN, .revents = 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    alignas(inotify_event) char buf[4096];
    const ssize_t n = ::read(watch, buf, sizeof(buf));
    for (ssize_t at = 0; n > 0 && at < n && !killed;) {
      const auto* ev = reinterpret_cast<const inotify_event*>(buf + at);
      at += static_cast<ssize_t>(sizeof(inotify_event) + ev->len);
      const std::string name = ev->len ? ev->name : "";
      // ".<final name>.tmp.<pid>.<n>", of a checkpoint (last.ckpt's link has one too)
      const size_t mark = name.find(".tmp.");
      if (name.rfind(".epoch=", 0) != 0 || mark == std::string::npos) continue;
      const pid_t writer = static_cast<pid_t>(std::stol(name.substr(mark + 5)));
      if (::kill(writer, SIGSTOP) != 0) continue;
      const std::vector<pid_t> workers = children_of(p.pid());
      if (fs::exists(ckpts / name) &&
          std::find(workers.begin(), workers.end(), writer) != workers.end()) {
        ASSERT_EQ(::kill(writer, SIGKILL), 0);
        killed = writer, temp = name;
      } else {
        ::kill(writer, SIGCONT);  // renamed already: the next one
        ++late;
      }
    }
  }
  ::close(watch);
  ASSERT_NE(killed, 0) << "no writer caught before its rename (" << late << " late)\n"
                       << p.err_so_far();
  std::printf("[ measured ] writer pid %d SIGKILLed with %s unrenamed (%d writer(s) caught late)\n",
              static_cast<int>(killed), temp.c_str(), late);
  const Result& r = p.wait();
  ASSERT_TRUE(r.exited(0)) << r.describe();
  expect_a_run_that_lost_a_step_not_the_run(r, out, samples, kImages, kEpochs);

  // The dead writer's temporary: never a checkpoint, removed by a later save.
  EXPECT_FALSE(fs::exists(ckpts / temp));
  const std::string unfinished = temp.substr(1, temp.find(".tmp.") - 1);  // its final name
  int64_t newest = -1;
  int count = 0;
  for (const auto& e : fs::directory_iterator(ckpts)) {
    const std::string name = e.path().filename().string();
    EXPECT_EQ(name.find(".tmp."), std::string::npos) << name << " left behind";
    if (e.path().extension() != ".ckpt") continue;
    ++count;
    EXPECT_NO_THROW(verify_checkpoint(e.path())) << name;
    newest = std::max(newest, read_checkpoint_meta(e.path()).step);
  }
  EXPECT_GT(count, 0);
  const size_t step_at = unfinished.find("step=");
  ASSERT_NE(step_at, std::string::npos) << unfinished;
  EXPECT_GT(newest, std::stol(unfinished.substr(step_at + 5)))
      << "the job checkpointed again after the kill";
}

// ddp-train --ft where it cannot work: not under ddprun --ft, and with state that does not
// follow a re-formed group; each says why at once (exit 2).
TEST_F(FtJob, DdpTrainFtRefusesWhatItCannotDo) {
  Subprocess alone = Subprocess::start({.argv = {kDdpTrain, "--ft"}, .timeout_s = 60});
  const Result& a = alone.wait();
  EXPECT_EQ(a.exit_code, 2) << a.describe();
  EXPECT_NE(a.err.find("--ft needs a coordination store that outlives every replica, which "
                       "ddprun --ft hosts"),
            std::string::npos)
      << a.err;
  Subprocess zero = Subprocess::start({.argv = {kDdpTrain, "--ft", "--zero"}, .timeout_s = 60});
  const Result& z = zero.wait();
  EXPECT_EQ(z.exit_code, 2) << z.describe();
  EXPECT_NE(z.err.find("--ft with --zero: its state does not follow a re-formed group yet"),
            std::string::npos)
      << z.err;

  // A checkpoint written without --ft lacks the manager's step: the first quorum says so and the
  // job ends (no quorum after quorum trying it again).
  const std::vector<std::string> common =
      {"--model",   "mlp", "--train-subset", "500",          "--test-subset",        "100",
       "--workers", "0",   "--no-plots",     "--output-dir", (dir_ / "run").string()};
  std::vector<std::string> plain = {kDdpTrain, "--max-steps", "3"};
  plain.insert(plain.end(), common.begin(), common.end());
  Subprocess first = Subprocess::start({.argv = plain, .timeout_s = 120});
  ASSERT_TRUE(first.wait().exited(0)) << first.wait().describe();
  std::vector<std::string> ft_job = {kDdprun, "--ft", "--standalone", "--nproc-per-node", "2"};
  ft_job.insert(ft_job.end(), {kDdpTrain, "--ft", "--resume", "auto"});
  ft_job.insert(ft_job.end(), common.begin(), common.end());
  Subprocess resumed = Subprocess::start({.argv = ft_job, .timeout_s = 120});
  const Result& r = resumed.wait();
  const std::string said = r.out + r.err;
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(said.find("this checkpoint does not fit this run: it holds no 'ft.step' state"),
            std::string::npos)
      << said;
  EXPECT_EQ(said.find("not committed (quorum 1"), std::string::npos) << said;
}

// --max-restarts 0: nothing to start again with; the first death ends the job, named. With 1,
// the second: the job fails saying --ft's restart is spent, and nothing else (it once added that
// a usage error would repeat, with restarts "left").
TEST_F(FtJob, WithItsRestartsSpentAFailureEndsTheJob) {
  const fs::path out = dir_ / "run";
  Subprocess p = job(2, 0, out, 100000, 10);
  const std::vector<pid_t> workers = workers_past(p, 2, out, 5);
  ASSERT_EQ(workers.size(), 2u) << p.err_so_far();
  ASSERT_EQ(::kill(workers[1], SIGKILL), 0);
  const Result& r = p.wait();
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.err.find("rank 1 failed (SIGKILL (signal 9)); --ft's 0 restart(s) (--max-restarts) "
                       "are spent: the job fails"),
            std::string::npos)
      << r.err;
  EXPECT_LT(r.wall_s, 120);

  const fs::path out1 = dir_ / "run1";
  Subprocess once = job(2, 1, out1, 100000, 10);
  std::vector<pid_t> first = workers_past(once, 2, out1, 5);
  ASSERT_EQ(first.size(), 2u) << once.err_so_far();
  ASSERT_EQ(::kill(first[1], SIGKILL), 0);
  std::vector<pid_t> again;  // the one started again, once it runs
  testing::wait_until(
      [&] {
        again = children_of(once.pid());
        return again.size() == 2 && again != first;
      },
      60);
  ASSERT_EQ(again.size(), 2u) << once.err_so_far();
  const pid_t restarted = again[0] == first[0] ? again[1] : again[0];
  ASSERT_EQ(::kill(restarted, SIGKILL), 0);
  const Result& r1 = once.wait();
  EXPECT_EQ(r1.exit_code, 1) << r1.describe();
  EXPECT_NE(r1.err.find("--ft's 1 restart(s) (--max-restarts) are spent: the job fails"),
            std::string::npos)
      << r1.err;
  EXPECT_EQ(r1.err.find("usage or configuration error"), std::string::npos) << r1.err;
}

}  // namespace
}  // namespace ddp
