// Several hosts for real: network namespaces joined by veth links to a bridge (support/netns.h),
// one ddprun per host with --nnodes, --node-rank and host 0's address, two workers per host (so
// the group runs the shm+gloo hierarchy). Training across hosts equals training on one host; a
// link taken down mid-training fails every rank within the collective timeout, naming the rank
// across the link, and leaves no process; a slow link slows training but does not fail it.
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/netns.h"
#include "support/saved_state.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

// Command lines and worker scripts are laid out by hand (a flag with its value, an action with
// its arguments), which clang-format would put one string per line.
// clang-format off
namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Hosts;
using testing::Result;
using testing::Subprocess;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kWorker = testing::env_or_die("EQUIVALENCE_WORKER");
const std::string kTrain = testing::env_or_die("DDP_TRAIN");

class MultiNode : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!Hosts::available(&why) || !Hosts::usable(&why)) GTEST_SKIP() << why;
    dir_ = ddp::testing::make_temp_dir("ddp_multinode");
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // ddprun on host k of `hosts`, 2 workers, host 0's address as the master.
  Subprocess node(const Hosts& hosts, int k, int port, std::vector<std::string> program,
                  std::vector<std::string> extra = {}, double timeout_s = 180,
                  std::map<std::string, std::string> env = {}) {
    std::vector<std::string> argv = {kDdprun, "--nnodes", "2", "--node-rank", std::to_string(k),
                                     "--nproc-per-node", "2", "--master-addr", hosts.address(0),
                                     "--master-port", std::to_string(port)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), program.begin(), program.end());
    env.emplace("DDP_DEBUG", "info");
    return hosts.start(k, argv, env, timeout_s);
  }

  fs::path dir_;
};

TEST_F(MultiNode, TrainingAcrossHostsEqualsOneHost) {
  const fs::path one = dir_ / "one.pt", many = dir_ / "many.pt";
  Result ref = testing::run_command({.argv = {kWorker, "cnn", one.string(), "--chunks", "4"},
                                     .timeout_s = 120});
  ASSERT_TRUE(ref.exited(0)) << ref.describe();
  Hosts hosts(2);
  const std::vector<std::string> program = {kWorker, "cnn", many.string(), "--chunks", "4"};
  auto h0 = node(hosts, 0, 29500, program);
  auto h1 = node(hosts, 1, 29500, program);
  const Result& r0 = h0.wait();
  const Result& r1 = h1.wait();
  ASSERT_TRUE(r0.exited(0)) << r0.describe();
  ASSERT_TRUE(r1.exited(0)) << r1.describe();
  EXPECT_NE(r0.err.find("of 4 ranks over shm+gloo"), std::string::npos) << r0.describe();
  auto a = testing::load_state(one), b = testing::load_state(many);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) {
    ASSERT_EQ(b.count(name), 1u) << name;
    EXPECT_LE((tensor - b[name]).abs().max().item<double>(), 1e-5) << name;
  }
}

// PyTorch programs across hosts under ddprun, as under torchrun: their TCPStore clients cannot
// use ddprun's agent store, so global rank 0 hosts theirs (Note [Restart rounds]), whether
// PROGRAM is the script or the interpreter (`ddprun ... /usr/bin/python3 x.py`; the latter was
// a worker's std::bad_alloc inside PyTorch's TCPStore client).
TEST_F(MultiNode, PyTorchProgramsRunAcrossHostsUnderDdprun) {
  if (::access("/usr/bin/python3", X_OK) != 0 ||
      testing::run_command({.argv = {"/usr/bin/python3", "-c", "import torch.distributed"},
                            .timeout_s = 60})
              .exit_code != 0) {
    GTEST_SKIP() << "needs python3-torch";
  }
  const fs::path script = dir_ / "allreduce.py";
  {
    std::ofstream py(script);
    py << "import torch, torch.distributed as dist\n"
          "dist.init_process_group('gloo')\n"
          "t = torch.tensor([float(dist.get_rank() + 1)])\n"
          "dist.all_reduce(t)\n"
          "print(f'rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():.0f}')\n"
          "dist.destroy_process_group()\n";
  }
  Hosts hosts(2);
  int port = 29510;
  for (const auto& program : std::vector<std::vector<std::string>>{
           {script.string()}, {"/usr/bin/python3", script.string()}}) {
    SCOPED_TRACE(program.front());
    std::vector<Subprocess> nodes;
    for (int k = 0; k < 2; ++k) {
      // PyTorch's Gloo binds the address of the hostname, which only these hosts' own
      // namespaces know: name the link instead.
      std::string link = hosts.host(k);
      link.replace(link.rfind('h'), 1, "v");
      // Debian's python3 first (ddprun runs a .py with the python3 of PATH).
      nodes.push_back(node(hosts, k, port, program, {}, 120,
                           {{"GLOO_SOCKET_IFNAME", link},
                            // Debian's PyTorch 2.6 is built without libuv, which its env://
                            // asks for unless told otherwise (1.13 ignores this).
                            {"USE_LIBUV", "0"},
                            {"PATH", std::string("/usr/bin:/bin:") + (std::getenv("PATH") ? std::getenv("PATH") : "")}}));
    }
    port += 2;
    std::string out;
    for (auto& n : nodes) {
      const Result& r = n.wait();
      EXPECT_TRUE(r.exited(0)) << r.describe();
      out += r.out;
    }
    for (int rank = 0; rank < 4; ++rank) {
      EXPECT_NE(out.find(fmt::format("rank {} of 4: sum 10", rank)), std::string::npos) << out;
    }
  }
}

TEST_F(MultiNode, LinkDownFailsEveryRankWithinTheTimeoutAndLeavesNothing) {
  Hosts hosts(2);
  const std::vector<std::string> train = {kTrain, "--model", "cnn", "--epochs", "5",
                                          "--train-subset", "20000", "--log-every", "2",
                                          "--output-dir", (dir_ / "run").string()};
  const std::vector<std::string> flags = {"--collective-timeout", "8", "--grace-period", "5"};
  auto h0 = node(hosts, 0, 29500, train, flags);
  auto h1 = node(hosts, 1, 29500, train, flags);
  // Unplug host 1 once training is under way (rank 0 prints progress every 2 steps).
  ASSERT_TRUE(testing::wait_until([&] { return h0.out_so_far().find("/79") != std::string::npos ||
                                               h0.out_so_far().find("epoch 1/") != std::string::npos; },
                                  120))
      << h0.out_so_far() << h0.err_so_far();
  hosts.set_link(1, false);
  const double down_at = h0.elapsed_s();
  const Result& r0 = h0.wait();
  const Result& r1 = h1.wait();
  EXPECT_FALSE(r0.timed_out) << r0.describe();
  EXPECT_FALSE(r1.timed_out) << r1.describe();
  EXPECT_EQ(r0.exit_code, 1) << r0.describe();
  EXPECT_EQ(r1.exit_code, 1) << r1.describe();
  // The collective timeout (8 s), the grace period (5 s), and slack for a loaded machine.
  EXPECT_LT(r0.wall_s - down_at, 40) << r0.describe();
  EXPECT_LT(r1.wall_s - down_at, 40) << r1.describe();
  // Host 0's ranks name their peers on host 1, and the reverse: the rail peer when the link
  // fails inside an all_reduce, else the hang report's ranks that did not answer or could not
  // be asked (the link took the store's host with it).
  const std::string all0 = r0.out + r0.err, all1 = r1.out + r1.err;
  auto names_any = [](const std::string& text, std::initializer_list<const char*> needles) {
    for (const char* n : needles) {
      if (text.find(n) != std::string::npos) return true;
    }
    return false;
  };
  EXPECT_TRUE(names_any(all0, {"failed between hosts: this rank exchanges its slice with rank 2",
                               "with rank 3", "rank 2 did not answer", "rank 3 did not answer"}))
      << r0.describe();
  EXPECT_TRUE(names_any(all1, {"with rank 0", "with rank 1", "rank 0 did not answer",
                               "rank 1 did not answer", "rank 0: no records (could not be asked",
                               "rank 1: no records (could not be asked"}))
      << r1.describe();
  EXPECT_EQ(all0.find("frame #"), std::string::npos) << "no C++ backtraces: " << r0.describe();
  EXPECT_EQ(hosts.processes(0), 0);
  EXPECT_EQ(hosts.processes(1), 0);
}

TEST_F(MultiNode, AHostWhoseProcessesAreAllKilledIsReportedByTheOther) {
  Hosts hosts(2);
  const std::vector<std::string> train = {kTrain, "--model", "cnn", "--epochs", "5",
                                          "--train-subset", "20000", "--log-every", "2",
                                          "--output-dir", (dir_ / "run").string()};
  const std::vector<std::string> flags = {"--collective-timeout", "30", "--grace-period", "5"};
  auto h0 = node(hosts, 0, 29500, train, flags);
  auto h1 = node(hosts, 1, 29500, train, flags);
  ASSERT_TRUE(testing::wait_until(
      [&] { return h0.out_so_far().find("epoch 1/") != std::string::npos; }, 120))
      << h0.out_so_far() << h0.err_so_far();
  // Everything on host 1 (its ddprun and both workers) dies at once, as in a node failure.
  std::system(fmt::format("ip netns pids {} | xargs -r kill -9", hosts.host(1)).c_str());
  const double killed_at = h0.elapsed_s();
  const Result& r0 = h0.wait();
  h1.wait();
  EXPECT_EQ(r0.exit_code, 1) << r0.describe();
  // A dead peer's sockets close at once: well inside the 30 s collective timeout.
  EXPECT_LT(r0.wall_s - killed_at, 25) << r0.describe();
  // Whichever collective noticed first names the other host: the hierarchical all_reduce its
  // peer rank, a Gloo collective (e.g. the buffer broadcast) the peer's address.
  const std::string all0 = r0.out + r0.err;
  EXPECT_TRUE(all0.find("with rank 2") != std::string::npos ||
              all0.find("with rank 3") != std::string::npos ||
              all0.find("[" + hosts.address(1) + "]") != std::string::npos)
      << r0.describe();
  EXPECT_EQ(hosts.processes(0), 0);
}

// A node failure with a scheduler that starts the node again: every process on one host is
// SIGKILLed after a checkpoint, a new ddprun starts there, and the job (--max-restarts, --resume
// auto) restarts on both hosts together (Note [Restart rounds] in tools/ddprun/rounds.h),
// resumes from the checkpoint and ends with the weights of an uninterrupted run. Host 1, then
// host 0, whose ddprun hosts the agent store: its new ddprun hosts a fresh one, which host 1's
// ddprun finds again. An mlp whose steps last at least 200 ms (--min-step-ms): the kill lands
// mid-job with the CPUs left idle.
TEST_F(MultiNode, AKilledHostStartedAgainRejoinsAndTheJobResumesFromItsCheckpoint) {
  auto train = [&](const std::string& name) {
    return std::vector<std::string>{kTrain, "--model", "mlp", "--min-step-ms", "200", "--epochs",
                                    "2", "--train-subset", "1536", "--test-subset", "1000",
                                    "--batch-size", "32",
                                    "--checkpoint-every", "5", "--resume", "auto", "--no-plots",
                                    "--workers", "1", "--output-dir", (dir_ / name).string()};
  };
  const std::vector<std::string> flags = {"--max-restarts", "2", "--rdzv-timeout", "60",
                                          "--collective-timeout", "30", "--grace-period", "5"};
  {
    Hosts hosts(2);
    auto h0 = node(hosts, 0, 29500, train("whole"), flags);
    auto h1 = node(hosts, 1, 29500, train("whole"), flags);
    const Result& w0 = h0.wait();
    const Result& w1 = h1.wait();
    ASSERT_TRUE(w0.exited(0)) << w0.describe();
    ASSERT_TRUE(w1.exited(0)) << w1.describe();
  }
  const auto whole = testing::load_state(dir_ / "whole" / "model_state.pt");

  for (const int killed : {1, 0}) {
    SCOPED_TRACE(fmt::format("host {} killed", killed));
    const std::string name = fmt::format("run{}", killed);
    const int kept = 1 - killed;
    Hosts hosts(2);
    std::vector<std::optional<Subprocess>> h(2);
    h[0].emplace(node(hosts, 0, 29500, train(name), flags));
    h[1].emplace(node(hosts, 1, 29500, train(name), flags));
    const fs::path ckpt = dir_ / name / "checkpoints" / "epoch=0-step=10.ckpt";
    ASSERT_TRUE(testing::wait_until([&] { return fs::exists(ckpt); }, 120))
        << h[0]->out_so_far() << h[0]->err_so_far();
    // The host fails whole (its ddprun and both workers); its scheduler starts ddprun again.
    std::system(fmt::format("ip netns pids {} | xargs -r kill -9", hosts.host(killed)).c_str());
    const double killed_at = h[kept]->elapsed_s();
    h[killed]->wait();
    EXPECT_TRUE(testing::wait_until([&] { return hosts.processes(killed) == 0; }, 10));
    h[killed].emplace(node(hosts, killed, 29500, train(name), flags));
    double restarted_at = -1;
    testing::wait_until([&] {
      if (h[kept]->err_so_far().find("restarting it") == std::string::npos) return false;
      restarted_at = h[kept]->elapsed_s();
      return true;
    }, 90);
    const Result& r0 = h[0]->wait();
    const Result& r1 = h[1]->wait();
    ASSERT_TRUE(r0.exited(0)) << r0.describe();
    ASSERT_TRUE(r1.exited(0)) << r1.describe();
    const Result& survivor = kept == 0 ? r0 : r1;
    EXPECT_NE(survivor.err.find("restarting it (restart 1 of 2)"), std::string::npos)
        << survivor.err;
    EXPECT_NE(r0.out.find("resumed from"), std::string::npos) << r0.out;
    std::printf("[ measured ] host %d killed: node %d restarting %.1f s later; the job finished "
                "%.1f s after the kill\n",
                killed, kept, restarted_at - killed_at, survivor.wall_s - killed_at);
    auto resumed = testing::load_state(dir_ / name / "model_state.pt");
    ASSERT_EQ(whole.size(), resumed.size());
    for (const auto& [param, tensor] : whole) {
      ASSERT_EQ(resumed.count(param), 1u) << param;
      EXPECT_TRUE(torch::equal(tensor, resumed[param])) << param << " differs after the restart";
    }
    EXPECT_EQ(hosts.processes(0), 0);
    EXPECT_EQ(hosts.processes(1), 0);
  }
}

TEST_F(MultiNode, SlowLinkSlowsTrainingButDoesNotFailIt) {
  auto run = [&](bool slow, const std::string& name) {
    Hosts hosts(2);
    if (slow) {
      hosts.shape(0, "8mbit");
      hosts.shape(1, "8mbit");
    }
    const std::vector<std::string> train = {kTrain, "--model", "mlp", "--epochs", "1",
                                            "--max-steps", "10", "--output-dir",
                                            (dir_ / name).string()};
    auto h0 = node(hosts, 0, 29500, train, {"--collective-timeout", "60"});
    auto h1 = node(hosts, 1, 29500, train, {"--collective-timeout", "60"});
    Result r0 = h0.wait(), r1 = h1.wait();
    EXPECT_TRUE(r0.exited(0)) << r0.describe();
    EXPECT_TRUE(r1.exited(0)) << r1.describe();
    return r0.wall_s;
  };
  const double fast = run(false, "fast");
  const double slow = run(true, "slow");
  // 10 steps, each moving ~0.5 MB of gradients per rank across an 8 Mbit/s (1 MB/s) link.
  EXPECT_GT(slow, fast + 3.0) << "fast " << fast << " s, slow " << slow << " s";
}

}  // namespace
}  // namespace ddp
// clang-format on
