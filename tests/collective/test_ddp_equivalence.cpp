// DDP's contract, checked numerically: N ranks with batch b each end, after 20 SGD steps, with
// the parameters one process gets with batch N*b on the same data (max abs diff <= 1e-5).
// Ranks are threads over Gloo; every rank starts from different random weights, so the
// initial broadcast from rank 0 is tested too.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/distributed_data_parallel.h"
#include "support/models.h"
#include "support/ranks.h"

namespace ddp {
namespace {

using namespace ddp::testing;

constexpr int kSteps = 20;
constexpr int64_t kPerRank = 4;  // batch per rank
constexpr double kTolerance = 1e-5;

torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

struct Data {
  std::vector<torch::Tensor> x, y;  // per step: [N*b, ...], [N*b]
};

Data make_data(int n, std::vector<int64_t> sample_shape, int64_t micro = 1) {
  torch::manual_seed(1234);
  Data d;
  std::vector<int64_t> shape{n * kPerRank * micro};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  for (int s = 0; s < kSteps; ++s) {
    d.x.push_back(torch::randn(shape));
    d.y.push_back(torch::randint(0, 10, {n * kPerRank * micro}));
  }
  return d;
}

// Rank r's rows of a global batch (rank-major, like a sharded loader).
torch::Tensor shard(const torch::Tensor& t, int r, int n) { return t.chunk(n)[r]; }

// Trains `world` thread-ranks with DDP. make() builds a fresh replica; init is copied into
// rank 0's replica only (the others start random). step(model, rank, step) returns the loss.
// Returns each rank's trained replica.
template <typename M, typename Step>
std::vector<std::shared_ptr<M>> train_ddp(int world,
                                          const std::function<std::shared_ptr<M>()>& make, M& init,
                                          DDPOptions options, const Step& step) {
  std::vector<std::shared_ptr<M>> replicas(world);
  const int port = free_port();
  auto errors = run_threads(world, [&](int r) {
    auto pg = make_process_group(thread_rank(r, world, port));
    auto replica = make();
    if (r == 0) copy_state(init, *replica);
    DDPOptions o = options;
    o.process_group = pg;
    DistributedDataParallel model(replica, o);
    auto opt = make_sgd(*replica);
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      step(model, r, s).backward();
      opt.step();
    }
    replicas[r] = replica;
    pg->barrier().wait();
  });
  for (int r = 0; r < world; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << message_of(errors[r]);
  }
  return replicas;
}

template <typename M>
void expect_all_equal(const std::vector<std::shared_ptr<M>>& replicas, M& reference) {
  for (size_t r = 0; r < replicas.size(); ++r) {
    ASSERT_TRUE(replicas[r]) << "rank " << r << " did not finish";
    EXPECT_LE(max_param_diff(*replicas[r], reference), kTolerance) << "rank " << r;
  }
}

// The one-process reference: a fresh model and a copy of its initial weights (rank 0's, in the
// DDP run); the reference is trained for kSteps with `step_loss(reference, s)` per step.
template <typename Holder, typename StepLoss>
std::pair<Holder, Holder> reference_and_init(const StepLoss& step_loss) {
  torch::manual_seed(7);
  Holder reference;
  Holder init;
  copy_state(*reference, *init);
  auto opt = make_sgd(*reference);
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    step_loss(reference, s).backward();
    opt.step();
  }
  return {reference, init};
}

class Equivalence : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

void check_mlp(int n, DDPOptions options) {
  Data data = make_data(n, {20});
  auto [reference, init] = reference_and_init<Mlp>(
      [&](Mlp& m, int s) { return torch::cross_entropy_loss(m(data.x[s]), data.y[s]); });
  auto replicas = train_ddp<MlpImpl>(
      n, [] { return Mlp().ptr(); }, *init, options,
      [&](auto& model, int r, int s) {
        return torch::cross_entropy_loss(model(shard(data.x[s], r, n)), shard(data.y[s], r, n));
      });
  expect_all_equal(replicas, *reference);
}

TEST_P(Equivalence, Mlp) { check_mlp(GetParam(), {}); }

TEST_P(Equivalence, MlpGradientAsBucketView) {
  check_mlp(GetParam(), {.gradient_as_bucket_view = true});
}

TEST_P(Equivalence, CnnWithBatchNormBuffersFromRankZero) {
  const int n = GetParam();
  Data data = make_data(n, {1, 12, 12});
  torch::manual_seed(7);
  Cnn reference;
  Cnn init;
  copy_state(*reference, *init);
  auto opt = make_sgd(*reference);
  // What N replicas compute: BatchNorm normalises each rank's b rows with their own batch
  // statistics, and rank 0's running statistics are the ones kept (broadcast each forward).
  // The loss is the mean of the ranks' losses = the mean over the N*b rows; each chunk is
  // backpropagated before the buffers are reset for the next (their graph saves them).
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    std::vector<torch::Tensor> before, after_rank0;
    for (const auto& b : reference->buffers()) before.push_back(b.clone());
    for (int k = 0; k < n; ++k) {
      if (k > 0) {
        torch::NoGradGuard g;
        auto bufs = reference->buffers();
        for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(before[i]);
      }
      (torch::cross_entropy_loss(reference(shard(data.x[s], k, n)), shard(data.y[s], k, n)) / n)
          .backward();
      if (k == 0) {
        for (const auto& b : reference->buffers()) after_rank0.push_back(b.clone());
      }
    }
    {
      torch::NoGradGuard g;
      auto bufs = reference->buffers();
      for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(after_rank0[i]);
    }
    opt.step();
  }
  auto replicas = train_ddp<CnnImpl>(
      n, [] { return Cnn().ptr(); }, *init, {},
      [&](auto& model, int r, int s) {
        return torch::cross_entropy_loss(model(shard(data.x[s], r, n)), shard(data.y[s], r, n));
      });
  expect_all_equal(replicas, *reference);
  // Running statistics: rank 0's, which its next forward would broadcast.
  auto ref_bufs = reference->named_buffers();
  for (const auto& item : replicas[0]->named_buffers()) {
    EXPECT_LE((item.value().to(torch::kDouble) - ref_bufs[item.key()].to(torch::kDouble))
                  .abs()
                  .max()
                  .item<double>(),
              kTolerance)
        << item.key();
  }
}

// Branch usage per (step, chunk): some steps use it on some ranks only, some on none.
std::vector<bool> branch_use(int s, int n) {
  std::vector<bool> use;
  for (int k = 0; k < n; ++k) use.push_back((s + k) % 3 != 0);
  return use;
}

TEST_P(Equivalence, UnusedParametersWithFindUnused) {
  const int n = GetParam();
  Data data = make_data(n, {20});
  auto [reference, init] = reference_and_init<Branchy>([&](Branchy& m, int s) {
    return torch::cross_entropy_loss(m(data.x[s], branch_use(s, n)), data.y[s]);
  });
  auto replicas = train_ddp<BranchyImpl>(
      n, [] { return Branchy().ptr(); }, *init, {.find_unused_parameters = true},
      [&](auto& model, int r, int s) {
        return torch::cross_entropy_loss(model(shard(data.x[s], r, n),
                                               std::vector<bool>{branch_use(s, n)[r]}),
                                         shard(data.y[s], r, n));
      });
  expect_all_equal(replicas, *reference);
  // Used by no rank, ever: its gradient stays undefined, as in PyTorch.
  for (const auto& replica : replicas) {
    EXPECT_FALSE(replica->never->weight.grad().defined());
  }
}

TEST_P(Equivalence, UnusedParametersWithStaticGraph) {
  const int n = GetParam();
  Data data = make_data(n, {20});
  // Static per rank: even ranks use the branch, odd ranks never do.
  std::vector<bool> use;
  for (int k = 0; k < n; ++k) use.push_back(k % 2 == 0);
  auto [reference, init] = reference_and_init<Branchy>(
      [&](Branchy& m, int s) { return torch::cross_entropy_loss(m(data.x[s], use), data.y[s]); });
  auto replicas = train_ddp<BranchyImpl>(
      n, [] { return Branchy().ptr(); }, *init, {.static_graph = true},
      [&](auto& model, int r, int s) {
        return torch::cross_entropy_loss(model(shard(data.x[s], r, n), std::vector<bool>{use[r]}),
                                         shard(data.y[s], r, n));
      });
  expect_all_equal(replicas, *reference);
}

TEST_P(Equivalence, ManySmallParametersInManyBuckets) {
  const int n = GetParam();
  Data data = make_data(n, {20});
  auto [reference, init] = reference_and_init<ManySmall>(
      [&](ManySmall& m, int s) { return torch::cross_entropy_loss(m(data.x[s]), data.y[s]); });
  size_t buckets = 0;
  // ~300 bytes per bucket: about one Linear(8, 8) each.
  DDPOptions tiny{.bucket_cap_mb = 0.0003, .first_bucket_mb = 0.0001};
  auto replicas = train_ddp<ManySmallImpl>(
      n, [] { return ManySmall().ptr(); }, *init, tiny,
      [&](auto& model, int r, int s) {
        if (s == kSteps - 1 && r == 0) buckets = model.bucket_layout().size();
        return torch::cross_entropy_loss(model(shard(data.x[s], r, n)), shard(data.y[s], r, n));
      });
  expect_all_equal(replicas, *reference);
  if (n > 1) EXPECT_GE(buckets, 15u);  // world size 1 passes gradients through
}

TEST_P(Equivalence, NoSyncAccumulationOfFourMicroBatchesEqualsOneBigBatch) {
  const int n = GetParam();
  constexpr int kMicro = 4;
  Data data = make_data(n, {20}, kMicro);  // per step: n ranks x 4 micro-batches x b rows
  auto [reference, init] = reference_and_init<Mlp>(
      [&](Mlp& m, int s) { return torch::cross_entropy_loss(m(data.x[s]), data.y[s]); });
  auto replicas = train_ddp<MlpImpl>(
      n, [] { return Mlp().ptr(); }, *init, {},
      [&](auto& model, int r, int s) {
        auto x = shard(data.x[s], r, n).chunk(kMicro);
        auto y = shard(data.y[s], r, n).chunk(kMicro);
        {
          auto guard = model.no_sync();
          for (int k = 0; k < kMicro - 1; ++k) {
            (torch::cross_entropy_loss(model(x[k]), y[k]) / kMicro).backward();
          }
        }
        return torch::cross_entropy_loss(model(x[kMicro - 1]), y[kMicro - 1]) / kMicro;
      });
  expect_all_equal(replicas, *reference);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Equivalence, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace ddp
