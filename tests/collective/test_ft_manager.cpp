// Per-step fault tolerance (Note [Per-step fault tolerance] in ddp/fault_tolerance.h), replicas as
// threads of one process over a coordination store the test hosts (as the launcher would): a
// replica that goes silent mid-step costs the others that step, not a restart (they re-form at
// the smaller size in their own threads and redo it); a replica that arrives later is healed
// live, bitwise, and the group grows. Every run ends equal to one process training on the same
// global batches for the same number of committed steps, every replica's parameters bitwise
// identical. DistributedDataParallel and the DistributedSampler follow the quorums by themselves
// when registered in the TrainingState: every sample of an epoch is trained once over the
// committed steps at whatever sizes the quorums had. DDP_TEST_BACKEND picks the transport (gloo,
// shm).
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/distributed_data_parallel.h"
#include "ddp/error.h"
#include "ddp/fault_tolerance.h"
#include "ddp/sampler.h"
#include "ddp/training_state.h"
#include "store/client.h"
#include "store/host.h"
#include "store/protocol.h"  // job_key
#include "support/ranks.h"   // free_port, test_backend

namespace ddp {
namespace {

using namespace std::chrono_literals;

constexpr int kGlobalBatch = 12;  // divisible by every world size the tests reach
constexpr int kSamples = 96;

// The data: fixed, the same in every replica.
struct Data {
  at::Tensor x, y;
  Data() {
    auto g = at::detail::createCPUGenerator(7);
    x = at::randn({kSamples, 8}, g);
    y = at::randn({kSamples, 1}, g);
  }
  // Step s's global batch, and rank r of `world`'s slice of it.
  std::pair<at::Tensor, at::Tensor> slice(int64_t step, int r, int world) const {
    const int64_t start = (step * kGlobalBatch) % kSamples, per = kGlobalBatch / world;
    return {x.narrow(0, start + r * per, per), y.narrow(0, start + r * per, per)};
  }
};
const Data& data() {
  static const Data d;
  return d;
}

struct Net : torch::nn::Module {
  explicit Net(uint64_t seed) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
    auto g = at::detail::createCPUGenerator(seed);
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(at::randn(p.sizes(), g) * 0.3);
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

torch::optim::SGD sgd(Net& net) {
  return torch::optim::SGD(net.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// One process on the global batches: what `steps` committed steps must give.
std::vector<at::Tensor> reference(int64_t steps) {
  Net net(1);
  auto opt = sgd(net);
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = data().slice(s, 0, 1);
    opt.zero_grad();
    torch::mse_loss(net.forward(x), y).backward();
    opt.step();
  }
  std::vector<at::Tensor> out;
  for (auto& p : net.parameters()) out.push_back(p.detach().clone());
  return out;
}

// A coordination store, hosted as the launcher hosts its agent store.
class FaultTolerance : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = testing::free_port();
    store_ = store::host({.master_addr = "127.0.0.1",
                          .port = port_,
                          .single_host = true,
                          .key = store::job_key("", "ft-test"),
                          .name = "the coordination store"});
  }

  ft::ManagerOptions options(const std::string& id, int min_replicas) const {
    ft::ManagerOptions o;
    o.store = fmt::format("127.0.0.1:{}", port_);
    o.secret = "";
    o.run_id = "ft-test";
    o.replica_id = id;
    o.min_replicas = min_replicas;
    o.quorum_timeout = 500ms;
    o.join_timeout = 60s;
    o.group.backend = testing::test_backend();
    o.group.timeout = 3s;
    o.group.rendezvous_timeout = 20s;
    return o;
  }

  // What one replica did.
  struct Outcome {
    std::vector<at::Tensor> params;
    bool job_finished = false;  // it came back after the others had finished
    int64_t steps = 0;
    int failed_steps = 0;
    std::vector<int> sizes;  // the quorum sizes it trained at, in order
    std::string error;
  };

  // Trains replica `id` until `until` committed steps. `stop_at(step)` runs after each step's
  // forward and backward, before any collective (it may sleep there: a replica away); true: the
  // replica goes silent at that step and leaves.
  Outcome replica(const std::string& id, uint64_t seed, int min_replicas, int64_t until,
                  std::function<bool(int64_t)> stop_at = {},
                  std::function<void(ft::Manager&, Net&)> after_first_quorum = {}) {
    Outcome out;
    try {
      Net net(seed);
      auto opt = sgd(net);
      TrainingState state;
      state.add("model", net);
      state.add("optimizer", opt);
      ft::Manager manager(state, options(id, min_replicas));
      bool first = true, left = false;
      while (manager.current_step() < until) {
        manager.start_quorum();
        if (manager.job_finished()) {
          out.job_finished = true;
          break;
        }
        if (first && after_first_quorum) after_first_quorum(manager, net);
        first = false;
        if (out.sizes.empty() || out.sizes.back() != manager.num_participants()) {
          out.sizes.push_back(manager.num_participants());
        }
        const int64_t s = manager.current_step();
        auto [x, y] = data().slice(s, manager.rank(), manager.num_participants());
        opt.zero_grad();
        torch::mse_loss(net.forward(x), y).backward();
        if (stop_at && stop_at(s)) {  // silent from here: the others' step fails
          left = true;
          break;
        }
        for (auto& p : net.parameters()) manager.allreduce(p.mutable_grad());
        if (manager.should_commit()) {
          opt.step();
        } else {
          ++out.failed_steps;
        }
        progress_.at(id) = manager.current_step();
      }
      if (!out.job_finished && !left) manager.finish();
      out.steps = manager.current_step();
      for (auto& p : net.parameters()) out.params.push_back(p.detach().clone());
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    return out;
  }

  int64_t progress(const std::string& id) {
    const auto it = progress_.find(id);
    return it == progress_.end() ? 0 : it->second.load();
  }

  int port_ = 0;
  std::unique_ptr<store::Server> store_;
  std::map<std::string, std::atomic<int64_t>> progress_;
};

void expect_bitwise_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                          const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << " " << i;
}

void expect_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-4, 1e-5))
        << "parameter " << i << ": " << (a[i] - b[i]).abs().max().item<float>();
  }
}

// 3 replicas; replica "c" goes silent at step 10 (a hung or dead peer). The other two fail that
// step (nobody applies it), re-form at 2 in their own threads and go on from step 10: every step
// committed once, the result that of one process.
TEST_F(FaultTolerance, ASilentReplicaCostsTheOthersOneStepNotARestart) {
  progress_["a"];
  progress_["b"];
  progress_["c"];
  constexpr int64_t kSteps = 24;
  std::vector<Outcome> out(3);
  const auto started = std::chrono::steady_clock::now();
  {
    std::vector<std::thread> threads;
    threads.emplace_back([&] { out[0] = replica("a", 1, 2, kSteps); });
    threads.emplace_back([&] { out[1] = replica("b", 1, 2, kSteps); });
    threads.emplace_back(
        [&] { out[2] = replica("c", 1, 2, kSteps, [](int64_t s) { return s == 10; }); });
    for (auto& t : threads) t.join();
  }
  std::printf(
      "[ measured ] 3 replicas, one silent at step 10: the others finished %ld steps in "
      "%.1f s (collective timeout 3 s)\n",
      static_cast<long>(kSteps),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(out[r].error, "") << "replica " << r;
    EXPECT_EQ(out[r].steps, kSteps);
    EXPECT_EQ(out[r].failed_steps, 1) << "the step in flight, once";
    EXPECT_EQ(out[r].sizes, (std::vector<int>{3, 2})) << "replica " << r;
  }
  expect_bitwise_equal(out[0].params, out[1].params, "the survivors");
  expect_close(out[0].params, reference(kSteps));
}

// 3 replicas; "c" is away for 5 s at step 10 (a SIGSTOP, a stalled host) without leaving. The
// others drop that step and re-form at 2; then they slow down (1.2 s a step), so that when "c"
// comes back its quorum waits long past quorum_timeout for them. It must not form one alone
// from its stale state, though min_replicas is 1 (the majority rule); it waits until they
// arrive, and is healed. It never trains at 1 replica.
TEST_F(FaultTolerance, AReplicaBackFromAwayNeverTrainsAloneAndIsHealed) {
  progress_["a"];
  progress_["b"];
  progress_["c"];
  constexpr int64_t kSteps = 20;
  auto slow = [](int64_t s) {
    if (s >= 11 && s <= 16) std::this_thread::sleep_for(1200ms);
    return false;
  };
  std::vector<Outcome> out(3);
  {
    std::vector<std::thread> threads;
    threads.emplace_back([&] { out[0] = replica("a", 1, 1, kSteps, slow); });
    threads.emplace_back([&] { out[1] = replica("b", 1, 1, kSteps, slow); });
    threads.emplace_back([&] {
      bool away = false;
      out[2] = replica("c", 1, 1, kSteps, [&](int64_t s) {
        if (s == 10 && !away) {
          away = true;
          std::this_thread::sleep_for(5s);
        }
        return false;
      });
    });
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out[r].error, "") << "replica " << r;
    EXPECT_EQ(out[r].steps, kSteps) << "replica " << r;
  }
  std::printf("[ measured ] sizes: a %s, c %s\n",
              fmt::format("{}", fmt::join(out[0].sizes, ", ")).c_str(),
              fmt::format("{}", fmt::join(out[2].sizes, ", ")).c_str());
  EXPECT_EQ(std::ranges::count(out[2].sizes, 1), 0) << "c trained alone from its stale state";
  EXPECT_EQ(out[0].sizes.back(), 3);
  expect_bitwise_equal(out[0].params, out[1].params, "a and b");
  expect_bitwise_equal(out[0].params, out[2].params, "c, healed");
  expect_close(out[0].params, reference(kSteps));
}

// The same, but the others finish while "c" is away: back, it finds the job finished past its
// step and nobody to heal it, and stops (job_finished()); it never trains from its stale state.
TEST_F(FaultTolerance, AReplicaBackAfterTheJobFinishedStopsWithoutTraining) {
  progress_["a"];
  progress_["b"];
  progress_["c"];
  constexpr int64_t kSteps = 20;
  std::vector<Outcome> out(3);
  {
    std::vector<std::thread> threads;
    threads.emplace_back([&] { out[0] = replica("a", 1, 1, kSteps); });
    threads.emplace_back([&] { out[1] = replica("b", 1, 1, kSteps); });
    threads.emplace_back([&] {
      out[2] = replica("c", 1, 1, kSteps, [&](int64_t s) {
        if (s == 10) {
          while (progress("a") < kSteps || progress("b") < kSteps) {
            std::this_thread::sleep_for(10ms);
          }
          std::this_thread::sleep_for(200ms);  // they call finish() and leave
        }
        return false;
      });
    });
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(out[r].error, "") << "replica " << r;
  EXPECT_EQ(out[0].steps, kSteps);
  EXPECT_TRUE(out[2].job_finished);
  EXPECT_EQ(out[2].steps, 10) << "c committed nothing after it came back";
  expect_bitwise_equal(out[0].params, out[1].params, "a and b");
  expect_close(out[0].params, reference(kSteps));
}

// A replica whose coordination store does not answer for 6 s (a cut link, a store host not up
// yet: longer than one store call may take) waits for it, up to the join timeout, instead of
// failing; then it forms its quorum and trains. (Before, the first unanswered call ended the
// replica, and under ddprun --ft each try burnt a restart while the link was down.)
TEST_F(FaultTolerance, AReplicaWaitsForAStoreThatDoesNotAnswerYet) {
  progress_["a"];
  constexpr int64_t kSteps = 4;
  port_ = testing::free_port();  // nothing listens there yet
  Outcome out;
  std::thread t([&] { out = replica("a", 1, 1, kSteps); });
  std::this_thread::sleep_for(6s);
  std::unique_ptr<store::Server> late = store::host({.master_addr = "127.0.0.1",
                                                     .port = port_,
                                                     .single_host = true,
                                                     .key = store::job_key("", "ft-test"),
                                                     .name = "the coordination store"});
  t.join();
  ASSERT_EQ(out.error, "");
  EXPECT_EQ(out.steps, kSteps);
  expect_close(out.params, reference(kSteps));
}

// An arrival counted whose entry never comes: a replica's add reached the store, its answer was
// lost with the link, and its retry counted it again (a cut's TCP retransmission can deliver the
// first one seconds later). The quorum takes it for lost after 2 s and forms without it. Before,
// its members waited for that entry until their join timeout, and under ddprun --ft the job
// failed (an even split, test_ft_multinode).
TEST_F(FaultTolerance, ALostArrivalIsVoidedNotWaitedFor) {
  progress_["a"];
  progress_["b"];
  constexpr int64_t kSteps = 4;
  store::Client lost({.host = "127.0.0.1",
                      .port = port_,
                      .key = store::job_key("", "ft-test"),
                      .identity = "a lost arrival",
                      .who = "[test]",
                      .owner = "the test"});
  lost.add("ft/ft-test/q0/arrived", 1, std::chrono::steady_clock::now() + 5s);
  const auto started = std::chrono::steady_clock::now();
  std::vector<Outcome> out(2);
  {
    std::thread a([&] { out[0] = replica("a", 1, 2, kSteps); });
    std::thread b([&] { out[1] = replica("b", 1, 2, kSteps); });
    a.join();
    b.join();
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(out[r].error, "") << "replica " << r;
    EXPECT_EQ(out[r].steps, kSteps);
    EXPECT_EQ(out[r].sizes, (std::vector<int>{2}));
  }
  EXPECT_LT(took, 20) << "the lost arrival was waited for";
  expect_bitwise_equal(out[0].params, out[1].params, "a and b");
  expect_close(out[0].params, reference(kSteps));
  std::printf("[ measured ] a lost arrival: the quorum formed and trained %ld steps in %.1f s\n",
              static_cast<long>(kSteps), took);
}

// A step of 10 ms, as a model's would take: a newcomer is seen within the watcher's 20 ms and
// admitted at the next step boundary, before the others finish.
bool paced(int64_t) {
  std::this_thread::sleep_for(10ms);
  return false;
}

// 2 replicas train; a third, with other initial weights and a fresh optimizer, arrives at
// step 8. At a step boundary soon after, the others admit it, it receives their state (model,
// optimizer's momentum, step) and the three go on: its weights equal theirs bit for bit from its
// first step, and the run equals one process's.
TEST_F(FaultTolerance, ANewcomerIsHealedLiveAndTheGroupGrows) {
  progress_["a"];
  progress_["b"];
  progress_["n"];
  constexpr int64_t kSteps = 24;
  std::vector<Outcome> out(3);
  std::optional<int64_t> healed_at;
  bool healed_differs = false;
  {
    std::vector<std::thread> threads;
    threads.emplace_back([&] { out[0] = replica("a", 1, 2, kSteps, paced); });
    threads.emplace_back([&] { out[1] = replica("b", 1, 2, kSteps, paced); });
    threads.emplace_back([&] {
      while (progress("a") < 8) std::this_thread::sleep_for(1ms);
      const Net fresh(99);
      out[2] = replica("n", 99, 1, kSteps, {}, [&](ft::Manager& m, Net& net) {
        healed_at = m.current_step();
        healed_differs = !torch::equal(net.parameters()[0], fresh.parameters()[0]);
      });
    });
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(out[r].error, "") << "replica " << r;
  ASSERT_TRUE(healed_at.has_value());
  EXPECT_GE(*healed_at, 8) << "it starts from the others' committed step, not 0";
  EXPECT_TRUE(healed_differs) << "its own initial weights were replaced";
  std::printf("[ measured ] newcomer healed at step %ld\n", static_cast<long>(*healed_at));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out[r].steps, kSteps);
    EXPECT_EQ(out[r].failed_steps, 0);
  }
  EXPECT_EQ(out[0].sizes, (std::vector<int>{2, 3}));
  EXPECT_EQ(out[2].sizes, (std::vector<int>{3}));
  expect_bitwise_equal(out[0].params, out[1].params, "a and b");
  expect_bitwise_equal(out[0].params, out[2].params, "the healed newcomer");
  expect_close(out[0].params, reference(kSteps));
}

// Under DDP, with the sampler: the program as a user writes it (the header's second example).
// "a", "b" and "c" start with different initial weights; "c" hangs before its forward at step 5
// (then leaves), so the others' bucketed all-reduce times out inside backward; "d" arrives when "a" has
// committed 12 steps. Checked: no step applied from a failed backward; the replicas bitwise
// equal (the first quorum gave everyone rank 0's weights); each epoch's samples trained over the
// committed steps once (the repeats only the sampler's padding, when a size does not divide the
// rest); and the result equal to one process training on the committed global batches.
TEST_F(FaultTolerance, DdpAndTheSamplerFollowTheQuorumsAndEachSampleTrainsOnce) {
  constexpr int64_t kSteps = 30, kPerRank = 4;
  struct Batch {
    int64_t epoch = 0, step = 0;
    int rank = 0;
    std::vector<int64_t> indices;
  };
  struct Run {
    std::vector<at::Tensor> params;
    std::vector<at::Tensor> initial;  // after the first quorum
    std::vector<Batch> committed;     // this replica's part of each committed step
    std::vector<int> sizes;
    int failed_steps = 0;
    std::string error;
  };
  std::atomic<int64_t> a_progress{0};
  auto run = [&](const std::string& id, uint64_t seed, std::function<bool(int64_t)> silent_at) {
    Run out;
    try {
      TrainingState state;
      ft::Manager manager(state, options(id, 2));
      auto net = std::make_shared<Net>(seed);
      DistributedDataParallel model(net, {.process_group = manager.process_group(),
                                          .bucket_cap_mb = 0.0002,
                                          .first_bucket_mb = 0.0002,
                                          .init_sync = false});
      auto opt = sgd(*net);
      DistributedSampler sampler(kSamples, {.num_replicas = 1, .rank = 0, .seed = 5});
      state.add("model", model);
      state.add("optimizer", opt);
      state.add("sampler", sampler);
      while (manager.current_step() < kSteps) {
        manager.start_quorum();
        if (out.sizes.empty() || out.sizes.back() != manager.num_participants()) {
          out.sizes.push_back(manager.num_participants());
        }
        if (out.initial.empty()) {
          for (auto& p : net->parameters()) out.initial.push_back(p.detach().clone());
        }
        if (sampler.remaining().empty()) sampler.set_epoch(sampler.epoch() + 1);
        const std::vector<int64_t> mine = sampler.remaining(kPerRank);
        sampler.advance(static_cast<int64_t>(mine.size()));
        const at::Tensor index = at::tensor(mine, at::kLong);
        const int64_t step = manager.current_step();
        if (silent_at && silent_at(step)) return out;  // gone: the others' step fails
        opt.zero_grad();
        try {
          torch::mse_loss(model(data().x.index_select(0, index)), data().y.index_select(0, index))
              .backward();
        } catch (const std::exception& e) {
          manager.report_error(e.what());
        }
        if (manager.should_commit()) {
          opt.step();
          out.committed.push_back({sampler.epoch(), step, manager.rank(), mine});
        } else {
          ++out.failed_steps;
        }
        if (id == "a") a_progress = manager.current_step();
      }
      manager.finish();
      for (auto& p : net->parameters()) out.params.push_back(p.detach().clone());
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    return out;
  };
  std::vector<Run> out(4);
  {
    std::vector<std::thread> threads;
    threads.emplace_back([&] { out[0] = run("a", 1, paced); });
    threads.emplace_back([&] { out[1] = run("b", 2, paced); });
    threads.emplace_back([&] {
      out[2] = run("c", 3, [](int64_t s) {
        if (s != 5) return false;
        std::this_thread::sleep_for(4s);  // hung past the collective timeout (3 s), then gone
        return true;
      });
    });
    threads.emplace_back([&] {
      while (a_progress < 12) std::this_thread::sleep_for(1ms);
      out[3] = run("d", 4, {});
    });
    for (auto& t : threads) t.join();
  }
  for (int r : {0, 1, 3}) {
    ASSERT_EQ(out[r].error, "") << "replica " << r;
    EXPECT_EQ(out[r].params.size(), 4u);
  }
  std::printf("[ measured ] sizes: a %s, d %s; a's failed steps %d\n",
              fmt::format("{}", fmt::join(out[0].sizes, ", ")).c_str(),
              fmt::format("{}", fmt::join(out[3].sizes, ", ")).c_str(), out[0].failed_steps);
  EXPECT_EQ(out[0].sizes.front(), 3);
  EXPECT_EQ(out[0].sizes.back(), 3) << "d joined";
  EXPECT_GE(std::ranges::count(out[0].sizes, 2), 1) << "the survivors went on at 2";
  EXPECT_EQ(out[0].failed_steps, 1) << "the step c left in, once";
  expect_bitwise_equal(out[0].initial, out[1].initial, "b's first weights: rank 0's");
  expect_bitwise_equal(out[0].initial, out[2].initial, "c's first weights: rank 0's");
  expect_bitwise_equal(out[0].params, out[1].params, "a and b");
  expect_bitwise_equal(out[0].params, out[3].params, "d, healed");

  // Every committed step's global batch (its ranks' parts in rank order), from all replicas.
  std::map<int64_t, std::map<int, Batch>> steps;
  for (const Run& r : out) {
    for (const Batch& b : r.committed) {
      auto [it, fresh] = steps[b.step].emplace(b.rank, b);
      if (!fresh)
        EXPECT_EQ(it->second.indices, b.indices) << "step " << b.step << " rank " << b.rank;
    }
  }
  ASSERT_EQ(steps.size(), static_cast<size_t>(kSteps));
  std::map<int64_t, std::vector<int>> seen;  // per epoch: how often each sample was trained
  Net reference_net(1);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < out[0].initial.size(); ++i) {
      reference_net.parameters()[i].copy_(out[0].initial[i]);
    }
  }
  auto reference_opt = sgd(reference_net);
  for (const auto& [step, parts] : steps) {
    std::vector<int64_t> global;
    const int64_t epoch = parts.begin()->second.epoch;
    auto& counts = seen[epoch];
    counts.resize(kSamples);
    for (const auto& [rank, b] : parts) {
      EXPECT_EQ(b.epoch, epoch);
      for (int64_t i : b.indices) ++counts[i];
      global.insert(global.end(), b.indices.begin(), b.indices.end());
    }
    EXPECT_EQ(static_cast<int>(parts.size()), parts.rbegin()->first + 1)
        << "step " << step << ": a rank's part is missing";
    const at::Tensor index = at::tensor(global, at::kLong);
    reference_opt.zero_grad();
    torch::mse_loss(reference_net.forward(data().x.index_select(0, index)),
                    data().y.index_select(0, index))
        .backward();
    reference_opt.step();
  }
  for (const auto& [epoch, counts] : seen) {
    const bool complete = epoch + 1 < static_cast<int64_t>(seen.size());
    int missing = 0, repeats = 0;
    for (int c : counts) {
      missing += c == 0;
      repeats += std::max(c - 1, 0);
    }
    std::printf("[ measured ] epoch %ld: %d repeat(s) (padding), %d not reached\n",
                static_cast<long>(epoch), repeats, missing);
    if (complete) EXPECT_EQ(missing, 0) << "epoch " << epoch;
    EXPECT_LE(repeats, 4) << "epoch " << epoch << ": more repeats than the padding of its reshards";
  }
  std::vector<at::Tensor> reference_params;
  for (auto& p : reference_net.parameters()) reference_params.push_back(p.detach().clone());
  expect_close(out[0].params, reference_params);
}

}  // namespace
}  // namespace ddp
