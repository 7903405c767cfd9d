// Per-step fault tolerance (Note [Per-step fault tolerance] in ddp/fault_tolerance.h), replicas as
// threads of one process over a coordination store the test hosts (as the launcher would): a
// replica that goes silent mid-step costs the others that step, not a restart (they re-form at
// the smaller size in their own threads and redo it); a replica that arrives later is healed
// live, bitwise, and the group grows. Every run ends equal to one process training on the same
// global batches for the same number of committed steps, every replica's parameters bitwise
// identical. DDP_TEST_BACKEND picks the transport (gloo, shm).
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

#include "ddp/error.h"
#include "ddp/fault_tolerance.h"
#include "ddp/training_state.h"
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

// 2 replicas train; a third, with other initial weights and a fresh optimizer, arrives at
// step 8. At the next step boundary the others admit it, it receives their state (model,
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
    threads.emplace_back([&] { out[0] = replica("a", 1, 2, kSteps); });
    threads.emplace_back([&] { out[1] = replica("b", 1, 2, kSteps); });
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

}  // namespace
}  // namespace ddp
