// Uneven inputs: ranks with different numbers of batches finish together under ddp::Join,
// with the parameters one process gets by averaging over the ranks that still had data.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/join.h"
#include "support/models.h"
#include "support/ranks.h"

namespace ddp {
namespace {

using namespace ddp::testing;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int64_t kPerRank = 4;

torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// Batch `step` of rank `rank`: deterministic, independent of the world size (a private
// generator: rank threads must not share the global one).
std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step) {
  auto gen = at::detail::createCPUGenerator(100 * rank + step);
  return {at::randn({kPerRank, 20}, gen), at::randint(0, 10, {kPerRank}, gen)};
}

// One process: at step s, the mean over the ranks that still have a batch (or the sum / N).
Mlp reference(const std::vector<int>& batches, bool divide_by_world, Mlp& init) {
  Mlp ref;
  copy_state(*init, *ref);
  auto opt = make_sgd(*ref);
  const int n = static_cast<int>(batches.size());
  const int steps = *std::max_element(batches.begin(), batches.end());
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    std::vector<int> active;
    for (int r = 0; r < n; ++r) {
      if (s < batches[r]) active.push_back(r);
    }
    torch::Tensor loss = torch::zeros({});
    for (int r : active) {
      auto [x, y] = batch(r, s);
      loss = loss + torch::cross_entropy_loss(ref(x), y);
    }
    (loss / (divide_by_world ? n : static_cast<int>(active.size()))).backward();
    opt.step();
  }
  return ref;
}

// Trains every rank on its `batches[r]` batches under a Join; returns the final replicas.
std::vector<Mlp> train_uneven(const std::vector<int>& batches, JoinOptions join_options,
                              DDPOptions ddp_options, Mlp& init, double* took_s = nullptr,
                              CommHook hook = nullptr) {
  const int n = static_cast<int>(batches.size());
  std::vector<Mlp> replicas(n, Mlp(nullptr));
  const int port = free_port();
  const auto start = Clock::now();
  auto errors = run_threads(n, [&](int r) {
    auto pg = make_process_group(thread_rank(r, n, port, /*timeout=*/20s));
    Mlp net;
    if (r == 0) copy_state(*init, *net);
    DDPOptions o = ddp_options;
    o.process_group = pg;
    DistributedDataParallel model(net, o);
    if (hook) model.register_comm_hook(hook);
    auto opt = make_sgd(*net);
    Join join(model, join_options);
    for (int s = 0; s < batches[r]; ++s) {
      auto [x, y] = batch(r, s);
      opt.zero_grad();
      torch::cross_entropy_loss(model(x), y).backward();
      opt.step();
    }
    join.finish();
    replicas[r] = net;
  });
  if (took_s) *took_s = std::chrono::duration<double>(Clock::now() - start).count();
  for (int r = 0; r < n; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << message_of(errors[r]);
  }
  return replicas;
}

class JoinTest : public ::testing::Test {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_F(JoinTest, UnevenBatchesAverageOverRanksStillTraining) {
  for (const std::vector<int>& batches :
       std::vector<std::vector<int>>{{5, 3, 1}, {1, 4}, {2, 0, 3, 3}, {3, 3}}) {
    SCOPED_TRACE(fmt::format("batches per rank: {}", fmt::join(batches, ", ")));
    torch::manual_seed(7);
    Mlp init;
    Mlp ref = reference(batches, /*divide_by_world=*/false, init);
    double took = 0;
    auto replicas = train_uneven(batches, {}, {}, init, &took);
    for (size_t r = 0; r < replicas.size(); ++r) {
      ASSERT_TRUE(replicas[r]) << "rank " << r;
      EXPECT_LE(max_param_diff(*replicas[r], *ref), 1e-5) << "rank " << r;
    }
    EXPECT_LT(took, 15.0);
  }
}

TEST_F(JoinTest, DivideByInitialWorldSizeAsPyTorchsDefault) {
  const std::vector<int> batches = {4, 2, 1};
  torch::manual_seed(7);
  Mlp init;
  Mlp ref = reference(batches, /*divide_by_world=*/true, init);
  auto replicas = train_uneven(batches, {.divide_by_initial_world_size = true}, {}, init);
  for (size_t r = 0; r < replicas.size(); ++r) {
    EXPECT_LE(max_param_diff(*replicas[r], *ref), 1e-5) << "rank " << r;
  }
}

TEST_F(JoinTest, ShadowsHooksBucketsAndBitmapsWithoutHanging) {
  // fp16 buckets and many of them, and the used-parameter bitmap: the joined rank must issue
  // the very same collectives (dtype, size, order), or this deadlocks / fails.
  torch::manual_seed(7);
  Mlp init;
  auto replicas = train_uneven({3, 1, 2}, {},
                               {.bucket_cap_mb = 0.002,
                                .first_bucket_mb = 0.001,
                                .find_unused_parameters = true},
                               init, nullptr, comm_hooks::fp16_compress());
  for (size_t r = 0; r < replicas.size(); ++r) ASSERT_TRUE(replicas[r]) << "rank " << r;
  for (size_t r = 1; r < replicas.size(); ++r) {
    EXPECT_EQ(max_param_diff(*replicas[r], *replicas[0]), 0.0);
  }
}

TEST_F(JoinTest, BuffersComeFromARankStillTrainingAndModelsEndIdentical) {
  const std::vector<int> batches = {1, 3};
  const int n = 2;
  const int port = free_port();
  std::vector<Cnn> replicas(n, Cnn(nullptr));
  auto errors = run_threads(n, [&](int r) {
    auto pg = make_process_group(thread_rank(r, n, port, /*timeout=*/20s));
    Cnn net;
    DistributedDataParallel model(net, {.process_group = pg});
    auto opt = make_sgd(*net);
    Join join(model);
    for (int s = 0; s < batches[r]; ++s) {
      torch::manual_seed(10 * r + s);
      opt.zero_grad();
      torch::cross_entropy_loss(model(torch::randn({4, 1, 12, 12})), torch::randint(0, 10, {4}))
          .backward();
      opt.step();
    }
    join.finish();
    replicas[r] = net;
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_FALSE(errors[r]) << "rank " << r << ": " << message_of(errors[r]);
  }
  EXPECT_EQ(max_param_diff(*replicas[1], *replicas[0]), 0.0);
  auto b0 = replicas[0]->named_buffers();
  for (const auto& item : replicas[1]->named_buffers()) {
    EXPECT_TRUE(torch::equal(item.value(), b0[item.key()])) << item.key();
  }
  // Rank 1 trained 3 batches: its running statistics counted 3 of them (rank 0's were stale).
  EXPECT_EQ(b0["bn1.num_batches_tracked"].item<int64_t>(), 3);
}

TEST_F(JoinTest, ThrowOnEarlyTerminationStopsEveryRank) {
  const std::vector<int> batches = {3, 1};
  const int port = free_port();
  std::vector<std::string> messages(2);
  const auto start = Clock::now();
  auto errors = run_threads(2, [&](int r) {
    auto pg = make_process_group(thread_rank(r, 2, port, /*timeout=*/20s));
    Mlp net;
    DistributedDataParallel model(net, {.process_group = pg});
    Join join(model, {.throw_on_early_termination = true});
    try {
      for (int s = 0; s < batches[r]; ++s) {
        auto [x, y] = batch(r, s);
        torch::cross_entropy_loss(model(x), y).backward();
      }
      join.finish();
    } catch (const Error& e) {
      messages[r] = e.what();
    }
  });
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0);
  EXPECT_NE(messages[0].find("another rank ran out of data"), std::string::npos) << messages[0];
  EXPECT_NE(messages[1].find("this rank ran out of data"), std::string::npos) << messages[1];
}

TEST_F(JoinTest, WithoutJoinUnevenInputsEndInATimeoutNotAHang) {
  const int port = free_port();
  std::string message;
  auto errors = run_threads(2, [&](int r) {
    auto pg = make_process_group(thread_rank(r, 2, port, /*timeout=*/2s));
    Mlp net;
    DistributedDataParallel model(net, {.process_group = pg});
    const int batches = r == 0 ? 2 : 1;
    try {
      for (int s = 0; s < batches; ++s) {
        auto [x, y] = batch(r, s);
        torch::cross_entropy_loss(model(x), y).backward();
      }
    } catch (const std::exception& e) {
      if (r == 0) message = e.what();
    }
    // Rank 1 leaves without its second step; rank 0's next collective (the one-time bucket
    // rebuild of its second forward) times out, named.
    if (r == 1) std::this_thread::sleep_for(4s);
  });
  EXPECT_NE(message.find("[rank 0] broadcast #"), std::string::npos) << message;
  EXPECT_NE(message.find("timed out after 2.0 s"), std::string::npos) << message;
}

}  // namespace
}  // namespace ddp
