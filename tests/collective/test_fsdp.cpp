// FullyShardedDataParallel (ZeRO-2), ranks as threads: training equals one process on the global
// batch at world sizes 1-4 (SGD with momentum and Adam, shards not divisible by the world size),
// every rank's gathered parameters bitwise alike, each rank holding only its shard between
// steps, nested units, and mistakes named.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "ddp/checkpoint.h"
#include "ddp/error.h"
#include "ddp/fully_sharded_data_parallel.h"
#include "ddp/training_state.h"
#include "state/adapters.h"  // optimizer_state: the earlier form of an FSDP optimizer's state
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

// Three units by default (a, b, c), sized so that no unit divides evenly by 3 or 4.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(6, 13));
    b = register_module("b", torch::nn::Linear(13, 7));
    c = register_module("c", torch::nn::Linear(7, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return c(torch::tanh(b(torch::relu(a(x))))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Mlp);

enum class Opt { kSgdMomentum, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, std::vector<at::Tensor> params) {
  if (o == Opt::kAdam) {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

constexpr int kSteps = 4;
std::mutex g_rng;  // the global generator is shared by the thread-ranks: seed and draw under it
constexpr int kGlobalBatch = 24;  // divisible by 1, 2, 3 and 4

at::Tensor inputs(int step) {
  return torch::randn({kGlobalBatch, 6}, at::TensorOptions().dtype(torch::kFloat))
      .mul_(1.0 + step);  // a different batch per step, the same on every rank (seeded below)
}

// Step s's global batch, the same on every rank: drawn from its own seed.
at::Tensor batch(int step) {
  std::lock_guard<std::mutex> lock(g_rng);
  torch::manual_seed(12 + 1000 * step);
  return inputs(step);
}

// A model (a module holder) drawn from `seed`.
template <typename Holder>
Holder seeded(uint64_t seed) {
  std::lock_guard<std::mutex> lock(g_rng);
  torch::manual_seed(seed);
  return Holder();
}

// Steps [first, last) on rank r of `world`: its slice of each step's batch.
template <typename Model>
void train_steps(Model& model, torch::optim::Optimizer& opt, int r, int world, int first,
                 int last) {
  const int per_rank = kGlobalBatch / world;
  for (int s = first; s < last; ++s) {
    const at::Tensor x = batch(s);
    opt.zero_grad();
    model(x.narrow(0, r * per_rank, per_rank)).pow(2).mean().backward();
    opt.step();
  }
}

// One process on the global batch, from `seed`: the reference, its parameters in order.
template <typename Holder>
std::vector<at::Tensor> single_process(Opt o, uint64_t seed) {
  Holder net = seeded<Holder>(seed);
  auto opt = make_optimizer(o, net->parameters());
  train_steps(net, *opt, 0, 1, 0, kSteps);
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

std::vector<at::Tensor> values_of(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named) out.push_back(t);
  return out;
}

void expect_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << testing::message_of(errors[r]);
  }
}

// Every rank's gathered parameters within float tolerance of `want`, and bitwise alike.
void expect_equal_on_every_rank(const std::vector<std::vector<at::Tensor>>& got,
                                const std::vector<at::Tensor>& want) {
  for (size_t r = 0; r < got.size(); ++r) {
    ASSERT_EQ(got[r].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[r][i].sizes(), want[i].sizes()) << "parameter " << i;
      EXPECT_TRUE(torch::allclose(got[r][i], want[i], 1e-5, 1e-6))
          << "parameter " << i << " on rank " << r << ": max |diff| "
          << (got[r][i] - want[i]).abs().max().item<double>();
      EXPECT_TRUE(torch::equal(got[r][i], got[0][i])) << "parameter " << i << " on rank " << r;
    }
  }
}

// `world` thread-ranks, each on its slice of the global batch; every rank's gathered parameters.
std::vector<std::vector<at::Tensor>> sharded(Opt o, int world) {
  std::vector<std::vector<at::Tensor>> finals(static_cast<size_t>(world));
  const int port = testing::free_port();
  auto errors = testing::run_threads(world, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, world, port));
    // Rank 0 starts from the reference's values; the others from other values, which the
    // construction replaces with rank 0's (sync_module_states).
    Mlp net = seeded<Mlp>(r == 0 ? 11 : 100 + r);
    FullyShardedDataParallel model(net, {.process_group = pg});
    auto opt = make_optimizer(o, model.parameters());
    train_steps(model, *opt, r, world, 0, kSteps);
    finals[r] = values_of(model.full_parameters());
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  return finals;
}

TEST(Fsdp, TrainingEqualsOneProcessOnTheGlobalBatchAtEveryWorldSize) {
  for (Opt o : {Opt::kSgdMomentum, Opt::kAdam}) {
    const auto want = single_process<Mlp>(o, 11);
    for (int world : {1, 2, 3, 4}) {
      SCOPED_TRACE(fmt::format("{} at world {}", o == Opt::kAdam ? "Adam" : "SGD", world));
      expect_equal_on_every_rank(sharded(o, world), want);
    }
  }
}

// Between steps a rank holds its shard only: each unit's flat shard is padded / world elements,
// and each parameter of the module is a 1-D view of its part inside that shard.
TEST(Fsdp, BetweenStepsEachRankHoldsItsShardOnly) {
  constexpr int kWorld = 4;
  const int port = testing::free_port();
  auto errors = testing::run_threads(kWorld, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, kWorld, port));
    Mlp net;
    FullyShardedDataParallel model(net, {.process_group = pg});
    const auto units = model.units();
    ASSERT_EQ(units.size(), 3u);
    EXPECT_EQ(units[0], (std::pair<std::string, size_t>{"a", 2}));
    EXPECT_EQ(units[2], (std::pair<std::string, size_t>{"c", 2}));
    // Unit sizes: a 6*13+13 = 91 -> 92 padded, 23 a rank; b 13*7+7 = 98 -> 100, 25;
    // c 7*3+3 = 24 -> 24, 6.
    const std::vector<int64_t> shard_sizes{23, 25, 6};
    const auto shards = model.parameters();
    ASSERT_EQ(shards.size(), 3u);
    int64_t held = 0;
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(shards[k].numel(), shard_sizes[k]) << k;
      EXPECT_TRUE(shards[k].is_leaf() && shards[k].requires_grad());
    }
    for (const at::Tensor& p : net->parameters()) {
      EXPECT_EQ(p.dim(), 1);
      held += p.numel();
    }
    // What this rank's views cover: its shards less the padding (only the last rank pads).
    const int64_t padding = r == kWorld - 1 ? (92 - 91) + (100 - 98) : 0;
    EXPECT_EQ(held, 23 + 25 + 6 - padding);
    // A step: full shapes during forward and backward, shards again after.
    at::Tensor y = model(torch::randn({2, 6}));
    EXPECT_EQ(net->a->weight.sizes(), (std::vector<int64_t>{13, 6}));
    y.sum().backward();
    EXPECT_EQ(net->a->weight.dim(), 1);
    EXPECT_FALSE(net->a->weight.grad().defined()) << "the full gradient is dropped";
    for (const at::Tensor& s : model.parameters()) {
      ASSERT_TRUE(s.grad().defined());
      EXPECT_EQ(s.grad().sizes(), s.sizes());
    }
    // Evaluation (no grad mode): gathered for the forward only.
    {
      torch::NoGradGuard no_grad;
      EXPECT_EQ(model(torch::randn({2, 6})).sizes(), (std::vector<int64_t>{2, 3}));
    }
    EXPECT_EQ(net->a->weight.dim(), 1);
    EXPECT_EQ(model.full_parameters().size(), 6u);
    // ZeRO-2 gathers every unit at once: its peak is the whole model.
    const FSDPMemoryStats m = model.memory_stats();
    EXPECT_EQ(m.shard_bytes, (23 + 25 + 6) * 4);
    EXPECT_EQ(m.full_bytes, (91 + 98 + 24) * 4);
    EXPECT_EQ(m.peak_gathered_bytes, (92 + 100 + 24) * 4);
  });
  expect_no_errors(errors);
}

struct NestedImpl : torch::nn::Module {
  NestedImpl() {
    outer = register_module("outer", torch::nn::Sequential(torch::nn::Linear(4, 5),
                                                           torch::nn::Linear(5, 4)));
    head = register_module("head", torch::nn::Linear(4, 2));
    scale = register_parameter("scale", torch::ones({2}));
  }
  at::Tensor forward(const at::Tensor& x) { return head(outer->forward(x)) * scale; }
  torch::nn::Sequential outer{nullptr};
  torch::nn::Linear head{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Nested);

// The innermost unit holds a parameter; what no unit holds is the root unit.
TEST(Fsdp, NestedUnitsAndTheRoot) {
  constexpr int kWorld = 2;
  const int port = testing::free_port();
  auto errors = testing::run_threads(kWorld, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, kWorld, port));
    Nested net;
    FullyShardedDataParallel model(net, {.process_group = pg,
                                         .units = {net->outer.ptr(), net->outer->ptr(1)}});
    const auto units = model.units();
    ASSERT_EQ(units.size(), 3u);
    // In the order of module->parameters(), which lists a module's own parameters (scale)
    // before its children's.
    EXPECT_EQ(units[0], (std::pair<std::string, size_t>{"(root)", 3}));  // scale and head's
    EXPECT_EQ(units[1], (std::pair<std::string, size_t>{"outer", 2}));   // outer.0's
    EXPECT_EQ(units[2], (std::pair<std::string, size_t>{"outer.1", 2}));
    model(torch::randn({3, 4})).sum().backward();
    const auto full = model.full_parameters();
    EXPECT_EQ(full.size(), 7u);
  });
  expect_no_errors(errors);
}

// ZeRO-3: the same three layers as ddp::Sharded units (each gathers itself for its forward and
// again for its backward), a root parameter beside them, and `a` called twice per forward.
struct ShardedMlpImpl : torch::nn::Module {
  ShardedMlpImpl() {
    a = register_module("a", Sharded<torch::nn::LinearImpl>(6, 6));
    b = register_module("b", Sharded<torch::nn::LinearImpl>(6, 7));
    c = register_module("c", Sharded<torch::nn::LinearImpl>(7, 3));
    gain = register_parameter("gain", torch::full({3}, 1.5));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(a(x));
    if (probe) probe(h);
    return c(torch::tanh(b(a(h)))) * gain;
  }
  Sharded<torch::nn::LinearImpl> a{nullptr}, b{nullptr}, c{nullptr};
  at::Tensor gain;
  std::function<void(at::Tensor&)> probe;  // sees a's first output in the forward
};
TORCH_MODULE(ShardedMlp);

TEST(Fsdp, ZeroThreeEqualsOneProcessOnTheGlobalBatch) {
  for (Opt o : {Opt::kSgdMomentum, Opt::kAdam}) {
    // The reference: the same model, not wrapped (a Sharded<M> alone is M).
    const auto want = single_process<ShardedMlp>(o, 21);
    for (int world : {1, 2, 3, 4}) {
      SCOPED_TRACE(fmt::format("{} at world {}", o == Opt::kAdam ? "Adam" : "SGD", world));
      std::vector<std::vector<at::Tensor>> got(static_cast<size_t>(world));
      const int port = testing::free_port();
      auto errors = testing::run_threads(world, [&](int r) {
        auto pg = make_process_group(testing::thread_rank(r, world, port));
        ShardedMlp net = seeded<ShardedMlp>(r == 0 ? 21 : 300 + r);
        FullyShardedDataParallel model(net, {.process_group = pg,
                                             .sharding_strategy = ShardingStrategy::kFullShard});
        auto opt = make_optimizer(o, model.parameters());
        train_steps(model, *opt, r, world, 0, kSteps);
        const auto full = model.full_parameters();
        EXPECT_EQ(full.front().first, "gain");  // the root unit's, own parameters first
        EXPECT_EQ(full[1].first, "a.weight") << "named without Sharded's \"module.\"";
        got[r] = values_of(full);
        pg->barrier().wait();
      });
      expect_no_errors(errors);
      expect_equal_on_every_rank(got, want);
    }
  }
}

// ZeRO-3's lifetimes: a Sharded unit is whole only inside its own forward and backward.
TEST(Fsdp, ZeroThreeHoldsAUnitWholeOnlyInsideItsForwardAndBackward) {
  constexpr int kWorld = 2;
  const int port = testing::free_port();
  auto errors = testing::run_threads(kWorld, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, kWorld, port));
    ShardedMlp net;
    FullyShardedDataParallel model(net, {.process_group = pg,
                                         .sharding_strategy = ShardingStrategy::kFullShard});
    const auto units = model.units();
    ASSERT_EQ(units.size(), 4u);
    EXPECT_EQ(units[0].first, "(root)");
    EXPECT_EQ(units[1].first, "a");
    auto whole = [](const Sharded<torch::nn::LinearImpl>& unit) {
      return unit->module->weight.dim() == 2;
    };
    bool checked_forward = false, checked_backward = false;
    net->probe = [&](at::Tensor& h) {
      // a has returned: freed; b and c not yet gathered (b's all_gather may be in flight).
      EXPECT_FALSE(whole(net->a));
      EXPECT_FALSE(whole(net->c));
      checked_forward = true;
      h.register_hook([&](const at::Tensor&) {
        // The backward reached a's first output: b and c are done and freed, a's first use
        // is next; a itself is whole, gathered for its second use's backward.
        EXPECT_FALSE(whole(net->b));
        EXPECT_FALSE(whole(net->c));
        checked_backward = true;
      });
    };
    at::Tensor y = model(torch::randn({4, 6}));
    EXPECT_FALSE(whole(net->a) || whole(net->b) || whole(net->c)) << "after the forward";
    y.sum().backward();
    EXPECT_TRUE(checked_forward && checked_backward);
    EXPECT_FALSE(whole(net->a) || whole(net->b) || whole(net->c)) << "after the backward";
    for (const at::Tensor& s : model.parameters()) EXPECT_TRUE(s.grad().defined());
    // Never every unit at once: root (3 -> 4 floats) with a (42) and b (49 -> 50) prefetched is
    // the most; the whole model is 3 + 42 + 49 + 24 floats.
    const FSDPMemoryStats m = model.memory_stats();
    EXPECT_EQ(m.full_bytes, (3 + 42 + 49 + 24) * 4);
    EXPECT_EQ(m.peak_gathered_bytes, (4 + 42 + 50) * 4);
    // Gathering the whole model for a save holds one unit at a time (b, 50 floats, the largest).
    model.reset_peak_memory_stats();
    EXPECT_EQ(model.full_parameters().size(), 7u);
    EXPECT_EQ(model.memory_stats().peak_gathered_bytes, 50 * 4);
  });
  expect_no_errors(errors);
}

// no_sync accumulation and clip_grad_norm_ over the shards, against one process: each step is
// two micro-batches (the first under no_sync, loss halved), then the gradient norm is clipped
// to 0.05 (below the norms seen: it clips every step) before SGD with momentum.
TEST(Fsdp, NoSyncAccumulatesAndClipGradNormSeesTheWholeModel) {
  constexpr double kMaxNorm = 0.05;
  for (ShardingStrategy strategy : {ShardingStrategy::kShardGradOp, ShardingStrategy::kFullShard}) {
    const bool z3 = strategy == ShardingStrategy::kFullShard;
    std::vector<at::Tensor> want;
    std::vector<double> want_norms;
    {
      ShardedMlp net = seeded<ShardedMlp>(31);
      auto opt = make_optimizer(Opt::kSgdMomentum, net->parameters());
      for (int s = 0; s < kSteps; ++s) {
        const at::Tensor x = batch(s);
        opt->zero_grad();
        for (int half = 0; half < 2; ++half) {
          (net->forward(x.narrow(0, half * kGlobalBatch / 2, kGlobalBatch / 2)).pow(2).mean() / 2)
              .backward();
        }
        want_norms.push_back(torch::nn::utils::clip_grad_norm_(net->parameters(), kMaxNorm));
        EXPECT_GT(want_norms.back(), 2 * kMaxNorm) << "the test means to clip every step";
        opt->step();
      }
      for (const at::Tensor& p : net->parameters()) want.push_back(p.detach().clone());
    }
    for (int world : {2, 3}) {
      SCOPED_TRACE(fmt::format("{} at world {}", z3 ? "ZeRO-3" : "ZeRO-2", world));
      std::vector<std::vector<at::Tensor>> got(static_cast<size_t>(world));
      const int port = testing::free_port();
      auto errors = testing::run_threads(world, [&](int r) {
        auto pg = make_process_group(testing::thread_rank(r, world, port));
        ShardedMlp net = seeded<ShardedMlp>(31);
        FullyShardedDataParallel model(net, {.process_group = pg, .sharding_strategy = strategy});
        auto opt = make_optimizer(Opt::kSgdMomentum, model.parameters());
        // Each micro-batch of the global batch split over the ranks.
        const int per_rank = kGlobalBatch / 2 / world;
        for (int s = 0; s < kSteps; ++s) {
          const at::Tensor x = batch(s);
          opt->zero_grad();
          for (int half = 0; half < 2; ++half) {
            const FSDPNoSyncGuard guard = model.no_sync(/*enabled=*/half == 0);
            const at::Tensor mine = x.narrow(0, half * kGlobalBatch / 2 + r * per_rank, per_rank);
            at::Tensor loss = model(mine).pow(2).mean() / 2;
            const uint64_t before = pg->last_sequence_number();
            loss.backward();
            if (half == 0) {
              // Nothing reduced (ZeRO-3's backward gathers its units, nothing more): the full
              // gradient stays on the parameter, whose data is its shard again.
              if (!z3) EXPECT_EQ(pg->last_sequence_number(), before) << "a collective ran";
              ASSERT_TRUE(net->b->module->weight.grad().defined());
              EXPECT_EQ(net->b->module->weight.grad().sizes(), (std::vector<int64_t>{7, 6}));
              EXPECT_EQ(net->b->module->weight.dim(), 1);
            } else {
              EXPECT_FALSE(net->b->module->weight.grad().defined()) << "reduced and dropped";
            }
          }
          const double norm = model.clip_grad_norm_(kMaxNorm);
          EXPECT_NEAR(norm, want_norms[static_cast<size_t>(s)], 1e-5 * want_norms[s]) << s;
          opt->step();
        }
        got[r] = values_of(model.full_parameters());
        pg->barrier().wait();
      });
      expect_no_errors(errors);
      expect_equal_on_every_rank(got, want);
    }
  }
}

// Rank 0's gathered parameters after `world` ranks restore `saved` into a fresh ShardedMlp
// (other initial values: seed + rank) with Adam and train steps 2 and 3.
std::vector<at::Tensor> resumed_from(const Snapshot& saved, int world, ShardingStrategy strategy,
                                     uint64_t seed) {
  std::vector<at::Tensor> out;
  const int port = testing::free_port();
  auto errors = testing::run_threads(world, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, world, port));
    ShardedMlp net = seeded<ShardedMlp>(seed + r);
    FullyShardedDataParallel model(net, {.process_group = pg, .sharding_strategy = strategy});
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
    TrainingState state;
    state.add("model", model);
    state.add("optimizer", opt, model);
    state.restore(saved, r, world);
    train_steps(model, opt, r, world, 2, 4);
    const auto full = values_of(model.full_parameters());
    if (r == 0) out = full;
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  return out;
}

void expect_same_bits(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::equal(got[i], want[i])) << "parameter " << i;
  }
}

// Through TrainingState: the model and the optimizer's state over the shards (each rank's pieces
// of each parameter, joined whole by a collective snapshot). A run restored from a snapshot
// continues bit for bit as the uninterrupted one; at another world size both load and training
// goes on as before.
TEST(Fsdp, CheckpointsResumeBitwiseAndTheModelLoadsAtAnotherWorldSize) {
  constexpr int kWorld = 2;
  Snapshot saved;  // rank 0's, after 2 steps
  std::vector<at::Tensor> uninterrupted;
  int port = testing::free_port();
  auto errors = testing::run_threads(kWorld, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, kWorld, port));
    ShardedMlp net = seeded<ShardedMlp>(21);
    FullyShardedDataParallel model(net, {.process_group = pg,
                                         .sharding_strategy = ShardingStrategy::kFullShard});
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
    TrainingState state;
    state.add("model", model);
    state.add("optimizer", opt, model);
    train_steps(model, opt, r, kWorld, 0, 2);
    Snapshot snap = state.snapshot(*pg);
    if (r == 0) saved = std::move(snap);
    train_steps(model, opt, r, kWorld, 2, 4);
    const auto full = values_of(model.full_parameters());
    if (r == 0) uninterrupted = full;
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  ASSERT_FALSE(uninterrupted.empty());
  // Resumed at the same world size, from other initial values: the same bits.
  expect_same_bits(resumed_from(saved, kWorld, ShardingStrategy::kFullShard, 500), uninterrupted);
  // At world size 3: the model loads (the saved parameters, bit for bit), and with the
  // optimizer's state, re-cut at the new shards, training goes on as the uninterrupted run did
  // (to float tolerance: other shards sum in another order).
  const Snapshot::Entry* saved_model = saved.find("model");
  ASSERT_NE(saved_model, nullptr);
  port = testing::free_port();
  errors = testing::run_threads(3, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 3, port));
    ShardedMlp net = seeded<ShardedMlp>(700 + r);
    FullyShardedDataParallel model(net, {.process_group = pg,
                                         .sharding_strategy = ShardingStrategy::kFullShard});
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
    TrainingState both;
    both.add("model", model);
    both.add("optimizer", opt, model);
    EXPECT_TRUE(both.restore(saved, r, 3).world_size_changed);
    train_steps(model, opt, r, 3, 2, 4);
    const auto went_on = values_of(model.full_parameters());
    for (size_t i = 0; i < went_on.size(); ++i) {
      EXPECT_TRUE(torch::allclose(went_on[i], uninterrupted[i], 1e-5, 1e-6))
          << "parameter " << i << ": max |diff| "
          << (went_on[i] - uninterrupted[i]).abs().max().item<double>();
    }
    TrainingState model_only;
    model_only.add("model", model);
    model_only.restore(saved, r, 3);
    const auto full = model.full_parameters();
    ASSERT_EQ(full.size(), saved_model->ranks[0].tensors.size());
    for (size_t i = 0; i < full.size(); ++i) {
      EXPECT_EQ(full[i].first, saved_model->ranks[0].tensors[i].first);
      EXPECT_TRUE(torch::equal(full[i].second, saved_model->ranks[0].tensors[i].second))
          << full[i].first;
    }
  });
  expect_no_errors(errors);
}

// What the ddp-cpp of 2026-11-30 saved for FullyShardedDataParallel: the parameters whole
// (kCollective) and each rank's optimizer state as a LibTorch archive (kPerRank). Such a
// snapshot still restores, at the saving world size, to a run that continues bit for bit.
TEST(Fsdp, ACheckpointOfTheEarlierFormStillResumesBitwise) {
  constexpr int kWorld = 2;
  Snapshot earlier;
  earlier.world_size = kWorld;
  earlier.entries = {{"model", StateScope::kCollective, {}},
                     {"optimizer", StateScope::kPerRank, std::vector<StateDict>(kWorld)}};
  std::vector<at::Tensor> uninterrupted;
  const int port = testing::free_port();
  auto errors = testing::run_threads(kWorld, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, kWorld, port));
    ShardedMlp net = seeded<ShardedMlp>(21);
    FullyShardedDataParallel model(net, {.process_group = pg});
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
    train_steps(model, opt, r, kWorld, 0, 2);
    auto full = model.full_parameters();
    if (r == 0) earlier.entries[0].ranks = {StateDict{.tensors = full}};
    earlier.entries[1].ranks[r] = state::optimizer_state(opt)->state_dict();
    train_steps(model, opt, r, kWorld, 2, 4);
    const auto after = values_of(model.full_parameters());
    if (r == 0) uninterrupted = after;
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  expect_same_bits(resumed_from(earlier, kWorld, ShardingStrategy::kShardGradOp, 300),
                   uninterrupted);
}

// --- Sharded checkpoints (CheckpointerOptions::sharded) -------------------------------------

namespace fs = std::filesystem;

// ZeRO-3 over ShardedMlp with Adam, and the TrainingState a run registers: the model (kSharded:
// each rank's pieces), the optimizer over the shards (each rank's own) and a replicated counter.
struct ShardedRun {
  ShardedRun(std::shared_ptr<ProcessGroup> pg, uint64_t seed)
      : net(seeded<ShardedMlp>(seed)),
        model(net,
              {.process_group = std::move(pg), .sharding_strategy = ShardingStrategy::kFullShard}),
        opt(model.parameters(), torch::optim::AdamOptions(0.01)) {
    state.add("model", model);
    state.add("optimizer", opt, model);
    state.add("counter", json_state([this] { return std::to_string(counter); },
                                    [this](const std::string& j) { counter = std::stoi(j); }));
  }
  ShardedMlp net;
  FullyShardedDataParallel<ShardedMlpImpl> model;
  torch::optim::Adam opt;
  int counter = 0;
  TrainingState state;
};

// The model's pieces in one rank file of a sharded checkpoint: elements per parameter name.
std::map<std::string, int64_t> pieces_in(const fs::path& rank_file) {
  std::ifstream in(rank_file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const DecodedCheckpoint d = decode_checkpoint(bytes, rank_file.string());
  std::map<std::string, int64_t> out;
  const Snapshot::Entry* model = d.snapshot.find("model");
  if (model == nullptr) return out;
  for (const auto& [name, t] : model->ranks.at(0).tensors) {
    EXPECT_NE(model->ranks[0].shard(name), nullptr) << name << " is not placed";
    out[name] = t.numel();
  }
  return out;
}

// Each rank writes its own part, in its own file; a run resumed from it goes on bit for bit;
// the model and the optimizer load at world sizes 1, 3 and 4, each rank taking its new part
// from the pieces, and training goes on as it would have.
TEST(FsdpCheckpoint, EachRankWritesItsOwnPartAndItLoadsAtAnyWorldSize) {
  constexpr int kWorld = 2;
  const fs::path dir = testing::make_temp_dir("fsdp_sharded");
  std::vector<at::Tensor> at_save, uninterrupted, resumed;
  int port = testing::free_port();
  auto errors = testing::run_threads(kWorld, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, kWorld, port));
    ShardedRun run(pg, 21);
    Checkpointer ckpt(dir, {.sharded = true});
    train_steps(run.model, run.opt, r, kWorld, 0, 2);
    run.counter = 7;
    ckpt.save(run.state, {.step = 2}, *pg);
    auto full = values_of(run.model.full_parameters());
    if (r == 0) at_save = full;
    train_steps(run.model, run.opt, r, kWorld, 2, 4);
    full = values_of(run.model.full_parameters());
    if (r == 0) uninterrupted = full;
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  ASSERT_FALSE(uninterrupted.empty());

  // The directory: metadata.ckpt and one file per rank, each holding that rank's pieces only.
  const fs::path saved = dir / "epoch=0-step=2.ckpt";
  ASSERT_TRUE(fs::is_directory(saved));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(saved)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{"metadata.ckpt", "rank-00000.ckpt", "rank-00001.ckpt"}));
  EXPECT_TRUE(fs::is_symlink(dir / "last.ckpt"));
  EXPECT_EQ(fs::read_symlink(dir / "last.ckpt"), "epoch=0-step=2.ckpt");
  // Units a (42 elements), b (49), c (24) and the root (gain, 3): shards of 21, 25, 12 and 2.
  const auto rank0 = pieces_in(saved / "rank-00000.ckpt");
  const auto rank1 = pieces_in(saved / "rank-00001.ckpt");
  int64_t total0 = 0, total1 = 0;
  for (const auto& [name, n] : rank0) total0 += n;
  for (const auto& [name, n] : rank1) total1 += n;
  EXPECT_EQ(total0, 21 + 25 + 12 + 2);
  EXPECT_EQ(total1, 42 + 49 + 24 + 3 - total0);
  EXPECT_EQ(rank0.at("a.weight"), 21);  // a.weight's 36 elements: 21 on rank 0, 15 on rank 1
  EXPECT_EQ(rank1.at("a.weight"), 15);
  EXPECT_EQ(read_checkpoint_meta(saved).world_size, kWorld);
  EXPECT_EQ(read_checkpoint_meta(saved).keys,
            (std::vector<std::string>{"model", "optimizer", "counter"}));

  // Resumed at the same world size, from other initial values: the same bits.
  port = testing::free_port();
  errors = testing::run_threads(kWorld, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, kWorld, port));
    ShardedRun run(pg, 500 + r);
    Checkpointer ckpt(dir, {.sharded = true});
    const ResumePoint found = ckpt.latest_valid(*pg);
    ASSERT_TRUE(found.path.has_value());
    EXPECT_EQ(found.path->filename(), "epoch=0-step=2.ckpt");
    const LoadedCheckpoint got = ckpt.load(*found.path, run.state, *pg);
    EXPECT_EQ(got.meta.step, 2);
    EXPECT_FALSE(got.world_size_changed);
    EXPECT_EQ(run.counter, 7);
    train_steps(run.model, run.opt, r, kWorld, 2, 4);
    const auto full = values_of(run.model.full_parameters());
    if (r == 0) resumed = full;
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  ASSERT_EQ(resumed.size(), uninterrupted.size());
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_TRUE(torch::equal(resumed[i], uninterrupted[i])) << "parameter " << i;
  }

  // At world sizes 1, 3 and 4: the model's saved bits, each rank taking its new part.
  for (int world : {1, 3, 4}) {
    SCOPED_TRACE(fmt::format("loaded at world {}", world));
    port = testing::free_port();
    errors = testing::run_threads(world, [&](int r) {
      auto pg = make_process_group(testing::thread_rank(r, world, port));
      ShardedRun run(pg, 700 + r);
      TrainingState model_only;
      model_only.add("model", run.model);
      model_only.add("counter",
                     json_state([] { return std::string("0"); },
                                [&](const std::string& j) { run.counter = std::stoi(j); }));
      const LoadedCheckpoint got = Checkpointer(dir).load(saved, model_only, *pg);
      EXPECT_TRUE(got.world_size_changed);
      EXPECT_EQ(run.counter, 7);
      const auto full = values_of(run.model.full_parameters());
      ASSERT_EQ(full.size(), at_save.size());
      for (size_t i = 0; i < full.size(); ++i) {
        EXPECT_TRUE(torch::equal(full[i], at_save[i])) << "parameter " << i << " on rank " << r;
      }
      // With the optimizer, re-cut at this world size's shards: training goes on as the
      // uninterrupted run did (to float tolerance: other shards sum in another order).
      Checkpointer(dir).load(saved, run.state, *pg);
      train_steps(run.model, run.opt, r, world, 2, 4);
      const auto went_on = values_of(run.model.full_parameters());
      for (size_t i = 0; i < went_on.size(); ++i) {
        EXPECT_TRUE(torch::allclose(went_on[i], uninterrupted[i], 1e-5, 1e-6))
            << "parameter " << i << " on rank " << r << ": max |diff| "
            << (went_on[i] - uninterrupted[i]).abs().max().item<double>();
      }
      pg->barrier().wait();
    });
    expect_no_errors(errors);
  }
  fs::remove_all(dir);
}

// A rank that cannot write its file fails the save on every rank and nothing is published (the
// temporary directory removed, last.ckpt and the older checkpoint intact); what a killed save
// leaves is ignored and then removed; a damaged or foreign
// rank file, or a missing metadata.ckpt, is found; keep-K and a second save of one step work on
// directories.
TEST(FsdpCheckpoint, AFailedRankPublishesNothingAndDamageIsFound) {
  constexpr int kWorld = 2;
  const fs::path dir = testing::make_temp_dir("fsdp_sharded_faults");
  const int port = testing::free_port();
  auto errors = testing::run_threads(kWorld, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, kWorld, port));
    ShardedRun run(pg, 21);
    const auto disk_full = [](std::string_view stage, const fs::path& file) {
      if (stage == "write" && file.filename() == "rank-00001.ckpt") {
        throw CheckpointError(file.string() + ": injected: no space left on device");
      }
    };
    Checkpointer ckpt(dir, {.keep = 2, .sharded = true});
    Checkpointer failing(dir, {.keep = 2, .fault_hook = disk_full, .sharded = true});
    train_steps(run.model, run.opt, r, kWorld, 0, 1);
    ckpt.save(run.state, {.step = 1}, *pg);
    if (r == 0) {  // what a save SIGKILLed half way leaves: ignored, then removed by a save
      const fs::path stale = dir / ".epoch=0-step=9.ckpt.tmp.999.0";
      fs::create_directories(stale);
      std::ofstream(stale / "rank-00000.ckpt") << "half a file";
      EXPECT_EQ(ckpt.latest_valid().path, dir / "epoch=0-step=1.ckpt");
      EXPECT_TRUE(ckpt.latest_valid().skipped.empty());
    }
    pg->barrier().wait();
    try {
      failing.save(run.state, {.step = 2}, *pg);
      ADD_FAILURE() << "a save with a failed rank succeeded";
    } catch (const CheckpointError& e) {
      const std::string want =
          r == 1 ? "injected: no space left on device" : "rank(s) 1 could not write their part of";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    pg->barrier().wait();
    if (r == 0) {
      EXPECT_FALSE(fs::exists(dir / "epoch=0-step=2.ckpt"));
      for (const auto& e : fs::directory_iterator(dir)) {
        EXPECT_NE(e.path().filename().string()[0], '.') << "left behind: " << e.path();
      }
      EXPECT_EQ(fs::read_symlink(dir / "last.ckpt"), "epoch=0-step=1.ckpt");
    }
    pg->barrier().wait();
    ckpt.save(run.state, {.step = 3}, *pg);
    ckpt.save(run.state, {.step = 3}, *pg);  // the same step again: swapped in
    train_steps(run.model, run.opt, r, kWorld, 1, 2);
    ckpt.save(run.state, {.step = 4}, *pg);  // keep = 2: step 1 goes
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  EXPECT_FALSE(fs::exists(dir / "epoch=0-step=1.ckpt"));
  const fs::path step3 = dir / "epoch=0-step=3.ckpt", step4 = dir / "epoch=0-step=4.ckpt";
  ASSERT_TRUE(fs::is_directory(step3));
  ASSERT_TRUE(fs::is_directory(step4));
  verify_checkpoint(step3);
  verify_checkpoint(step4);

  const auto corrupt_reason = [](const fs::path& path) -> std::string {
    try {
      verify_checkpoint(path);
    } catch (const CorruptCheckpointError& e) {
      return e.what();
    }
    return "(no error)";
  };
  // A byte of rank 1's payload flipped: step 4 is skipped, step 3 taken.
  {
    std::fstream f(step4 / "rank-00001.ckpt", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char c = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(-1, std::ios::end);
    f.put(c);
  }
  EXPECT_NE(corrupt_reason(step4).find("payload checksum mismatch"), std::string::npos)
      << corrupt_reason(step4);
  const ResumePoint found = Checkpointer(dir).latest_valid();
  ASSERT_TRUE(found.path.has_value());
  EXPECT_EQ(found.path->filename(), "epoch=0-step=3.ckpt");
  ASSERT_EQ(found.skipped.size(), 1u);
  EXPECT_EQ(found.skipped[0].path.filename(), "epoch=0-step=4.ckpt");
  // Another save's rank file in its place.
  fs::copy_file(step3 / "rank-00001.ckpt", step4 / "rank-00001.ckpt",
                fs::copy_options::overwrite_existing);
  EXPECT_NE(corrupt_reason(step4).find("a rank file of another save"), std::string::npos)
      << corrupt_reason(step4);
  fs::remove(step4 / "rank-00001.ckpt");
  EXPECT_NE(corrupt_reason(step4).find("rank 1's file is missing"), std::string::npos)
      << corrupt_reason(step4);
  fs::remove(step4 / "metadata.ckpt");
  EXPECT_NE(corrupt_reason(step4).find("a sharded checkpoint without its metadata.ckpt"),
            std::string::npos)
      << corrupt_reason(step4);
  fs::remove_all(dir);
}

// A unit with BatchNorm: the buffers are rank 0's after construction (sync_module_states), then
// not synchronised, so each rank's running statistics are its own; a checkpoint (sharded, or one file) gives each rank back its own at the saving world
// size, and rank r % 2's at world 3. Another model is refused, naming what differs.
struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    a = register_module("a", torch::nn::Linear(6, 5));
    bn = register_module("bn", torch::nn::BatchNorm1d(5));
    c = register_module("c", torch::nn::Linear(5, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return c(bn(a(x))); }
  torch::nn::Linear a{nullptr}, c{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Normed);

TEST(FsdpCheckpoint, EachRanksBuffersComeBackAsItsOwn) {
  const fs::path dir = testing::make_temp_dir("fsdp_buffers");
  std::vector<at::Tensor> mean(2), var(2);
  Snapshot joined;
  int port = testing::free_port();
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port));
    Normed net = seeded<Normed>(5);
    net->bn->running_mean.fill_(r + 1.0);  // sync_module_states: rank 0's go to every rank
    FullyShardedDataParallel model(net, {.process_group = pg});
    EXPECT_TRUE(torch::equal(net->bn->running_mean, torch::ones({5}))) << "rank " << r;
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    train_steps(model, opt, r, 2, 0, 2);  // each rank's half of the batch: its own statistics
    mean[r] = net->bn->running_mean.clone();
    var[r] = net->bn->running_var.clone();
    TrainingState state;
    state.add("model", model);
    Checkpointer(dir, {.sharded = true}).save(state, {.step = 2}, *pg);
    Snapshot snap = state.snapshot(*pg);
    if (r == 0) joined = std::move(snap);
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  ASSERT_FALSE(torch::equal(mean[0], mean[1])) << "the ranks' statistics should differ";
  for (int world : {2, 3}) {
    SCOPED_TRACE(fmt::format("loaded at world {}", world));
    port = testing::free_port();
    errors = testing::run_threads(world, [&](int r) {
      auto pg = make_process_group(testing::thread_rank(r, world, port));
      Normed net = seeded<Normed>(50 + r);
      FullyShardedDataParallel model(net, {.process_group = pg});
      TrainingState state;
      state.add("model", model);
      Checkpointer(dir).load(dir / "epoch=0-step=2.ckpt", state, *pg);
      EXPECT_TRUE(torch::equal(net->bn->running_mean, mean[r % 2])) << "rank " << r;
      EXPECT_TRUE(torch::equal(net->bn->running_var, var[r % 2])) << "rank " << r;
      net->bn->running_mean.zero_();
      state.restore(joined, r, world);
      EXPECT_TRUE(torch::equal(net->bn->running_mean, mean[r % 2])) << "rank " << r;
      pg->barrier().wait();
    });
    expect_no_errors(errors);
  }
  // Another model: refused, naming the differences, and nothing changes.
  port = testing::free_port();
  errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port));
    ShardedRun other(pg, 9);
    const auto before = values_of(other.model.full_parameters());
    try {
      Checkpointer(dir).load(dir / "epoch=0-step=2.ckpt", other.state, *pg);
      ADD_FAILURE() << "another model's checkpoint was loaded";
    } catch (const IncompatibleCheckpointError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'a.weight' is [5, 6] Float there, [6, 6] Float here"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("'gain' is missing"), std::string::npos) << msg;
      EXPECT_NE(msg.find("it holds no optimizer state under 'optimizer'"), std::string::npos)
          << msg;
    }
    const auto after = values_of(other.model.full_parameters());
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(after[i], before[i]));
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  fs::remove_all(dir);
}

// One process doing by hand what FSDP's ranks should, DDP's semantics: the fp32 model stepped by
// the optimizer; each step each rank's slice of the batch (from `batch_of`), in `accum`
// micro-batches whose losses are divided by `accum`, goes through a copy of it (in `low` and
// with its inputs cast, under mixed precision), the gradients accumulating on the copy; each
// rank's gradient rounded to `reduce`, summed over the ranks (in float, then rounded to `reduce`
// once, as the transports do), divided by the world size and cast back to fp32. Without
// BatchNorm and with fp32 this is one process on the global batch; with BatchNorm (statistics
// per micro-batch, as each rank has them) it is what DDP computes.
template <typename Holder>
std::vector<at::Tensor> emulated(Opt o, uint64_t seed, int world, at::Tensor (*batch_of)(int),
                                 int accum = 1, at::ScalarType low = torch::kFloat,
                                 at::ScalarType reduce = torch::kFloat) {
  Holder master = seeded<Holder>(seed);
  auto opt = make_optimizer(o, master->parameters());
  const std::vector<at::Tensor> params = master->parameters();
  const int per_rank = kGlobalBatch / world;
  const int per_micro = per_rank / accum;
  for (int s = 0; s < kSteps; ++s) {
    const at::Tensor x = batch_of(s);
    std::vector<at::Tensor> sum(params.size());
    for (int r = 0; r < world; ++r) {
      Holder copy = seeded<Holder>(seed);
      const std::vector<at::Tensor> copy_params = copy->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        copy_params[i].set_data(params[i].detach().to(low));
      }
      for (at::Tensor& b : copy->buffers()) {
        if (b.is_floating_point()) b.set_data(b.to(low));  // FSDP's buffer_dtype
      }
      for (int m = 0; m < accum; ++m) {
        const at::Tensor slice = x.narrow(0, r * per_rank + m * per_micro, per_micro).to(low);
        (copy(slice).pow(2).mean() / accum).backward();
      }
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor g = copy_params[i].grad().to(reduce).to(torch::kFloat);
        sum[i] = r == 0 ? g : sum[i] + g;
      }
    }
    opt->zero_grad();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = (sum[i].to(reduce) / world).to(torch::kFloat);
    }
    opt->step();
  }
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : params) out.push_back(p.detach().clone());
  return out;
}

// `got` (every rank's) against `want`: every rank alike; to the bit at world 1 and 2 (where a
// sum of two is the same in any order), else within `rtol`.
void expect_as_emulated(const std::vector<std::vector<at::Tensor>>& got,
                        const std::vector<at::Tensor>& want, double rtol = 1e-4) {
  const size_t world = got.size();
  for (size_t r = 0; r < world; ++r) {
    ASSERT_EQ(got[r].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[r][i].scalar_type(), want[i].scalar_type());
      EXPECT_TRUE(torch::equal(got[r][i], got[0][i])) << "parameter " << i << ", rank " << r;
      const double diff = (got[r][i] - want[i]).abs().max().item<double>();
      if (world <= 2) {
        EXPECT_TRUE(torch::equal(got[r][i], want[i]))
            << "parameter " << i << ": max |diff| " << diff;
      } else {
        EXPECT_TRUE(torch::allclose(got[r][i], want[i], rtol, rtol / 10))
            << "parameter " << i << ": max |diff| " << diff;
      }
    }
  }
}

// bf16 compute, fp32 (or bf16) gradient reduction, fp32 shards stepped by Adam; ZeRO-2 and
// ZeRO-3, world sizes 1-4. Each rank computes exactly what the emulation does, so at world 1
// and 2 (where a sum of two is the same in any order) the result is the same to the bit; at 3
// and 4 the transport sums in its own order. What the ranks hold is checked on the way: the
// module's parameters are bf16 during the forward and backward, the shards and their gradients
// fp32, a gathered unit half the bytes, and full_parameters() the fp32 values.
TEST(FsdpMixedPrecision, ComputesInBf16AndStepsTheFp32ShardsAsOneProcessDoingItByHand) {
  struct Case {
    bool zero3;
    at::ScalarType reduce;
    std::vector<int> worlds;
  };
  for (const Case& c :
       {Case{false, torch::kFloat, {1, 2, 3, 4}}, Case{true, torch::kFloat, {1, 2, 3, 4}},
        Case{false, torch::kBFloat16, {2, 3}}}) {
    const auto fp32 =
        c.zero3 ? single_process<ShardedMlp>(Opt::kAdam, 21) : single_process<Mlp>(Opt::kAdam, 11);
    for (int world : c.worlds) {
      SCOPED_TRACE(fmt::format("{}, reduced in {}, at world {}", c.zero3 ? "ZeRO-3" : "ZeRO-2",
                               c10::toString(c.reduce), world));
      const auto want =
          c.zero3
              ? emulated<ShardedMlp>(Opt::kAdam, 21, world, batch, 1, torch::kBFloat16, c.reduce)
              : emulated<Mlp>(Opt::kAdam, 11, world, batch, 1, torch::kBFloat16, c.reduce);
      std::vector<std::vector<at::Tensor>> got(static_cast<size_t>(world));
      const int port = testing::free_port();
      auto errors = testing::run_threads(world, [&](int r) {
        auto pg = make_process_group(testing::thread_rank(r, world, port));
        const FSDPOptions options{.process_group = pg,
                                  .sharding_strategy = c.zero3 ? ShardingStrategy::kFullShard
                                                               : ShardingStrategy::kShardGradOp,
                                  .mixed_precision = {.param_dtype = torch::kBFloat16,
                                                      .reduce_dtype = c.reduce}};
        std::vector<at::Tensor> params;
        auto train = [&](auto& model) {
          auto opt = make_optimizer(Opt::kAdam, model.parameters());
          train_steps(model, *opt, r, world, 0, kSteps);
          for (const at::Tensor& shard : model.parameters()) {
            EXPECT_EQ(shard.scalar_type(), torch::kFloat);
            EXPECT_EQ(shard.grad().scalar_type(), torch::kFloat);
          }
          for (const auto& part : model.local_shards()) {
            EXPECT_EQ(part.data.scalar_type(), torch::kFloat) << part.name;
          }
          got[r] = values_of(model.full_parameters());
        };
        if (c.zero3) {
          ShardedMlp net = seeded<ShardedMlp>(r == 0 ? 21 : 300 + r);
          FullyShardedDataParallel model(net, options);
          bool probed = false;
          net->probe = [&](at::Tensor& h) {
            EXPECT_EQ(h.scalar_type(), torch::kBFloat16) << "a's output";
            EXPECT_EQ(net->a->module->weight.scalar_type(), torch::kBFloat16);
            probed = true;
          };
          train(model);
          EXPECT_TRUE(probed);
          // The most gathered at once (the root, a, and b prefetched) at 2 bytes an element.
          model.reset_peak_memory_stats();
          model(torch::randn({2, 6})).sum().backward();
          auto padded = [world](int64_t n) {
            return std::max<int64_t>((n + world - 1) / world * world, world);
          };
          EXPECT_EQ(model.memory_stats().peak_gathered_bytes,
                    (padded(3) + padded(42) + padded(49)) * 2);
          EXPECT_EQ(model.memory_stats().full_bytes, (3 + 42 + 49 + 24) * 4) << "fp32, as DDP's";
        } else {
          Mlp net = seeded<Mlp>(r == 0 ? 11 : 100 + r);
          FullyShardedDataParallel model(net, options);
          train(model);
          EXPECT_EQ(net->a->weight.scalar_type(), torch::kBFloat16);
          const at::Tensor out = model(torch::randn({2, 6}));
          EXPECT_EQ(out.scalar_type(), torch::kBFloat16) << "the forward computes in bf16";
        }
        pg->barrier().wait();
      });
      expect_no_errors(errors);
      expect_as_emulated(got, want);
      // bf16 compute moved the result off the fp32 one, not far.
      double off = 0;
      for (size_t i = 0; i < fp32.size(); ++i) {
        off = std::max(off, (got[0][i] - fp32[i]).abs().max().item<double>());
      }
      EXPECT_GT(off, 0) << "the same as fp32: was it computed in bf16?";
      EXPECT_LT(off, 0.05);
    }
  }
}

// Buffers cast to buffer_dtype (what LibTorch 1.13's CPU BatchNorm needs with bf16 inputs),
// and a model saved under mixed precision holds the fp32 shards, loading into a wrapper
// without it to the bit.
TEST(FsdpMixedPrecision, BuffersTakeBufferDtypeAndCheckpointsHoldTheFp32Values) {
  const fs::path dir = testing::make_temp_dir("fsdp_mixed");
  std::vector<std::vector<at::Tensor>> saved(2);
  int port = testing::free_port();
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port));
    Normed net = seeded<Normed>(5);
    FullyShardedDataParallel model(net, {.process_group = pg,
                                         .mixed_precision = {.param_dtype = torch::kBFloat16,
                                                             .reduce_dtype = torch::kFloat,
                                                             .buffer_dtype = torch::kBFloat16}});
    EXPECT_EQ(net->bn->running_mean.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(net->bn->num_batches_tracked.scalar_type(), torch::kLong) << "not floating point";
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    train_steps(model, opt, r, 2, 0, 2);
    TrainingState state;
    state.add("model", model);
    Checkpointer(dir, {.sharded = true}).save(state, {.step = 2}, *pg);
    saved[r] = values_of(model.full_parameters());
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  port = testing::free_port();
  errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port));
    Normed net = seeded<Normed>(6);
    for (auto& b : net->buffers()) {
      if (b.is_floating_point()) b.set_data(b.to(torch::kBFloat16));  // the saved buffers' dtype
    }
    FullyShardedDataParallel model(net, {.process_group = pg});
    TrainingState state;
    state.add("model", model);
    Checkpointer ckpt(dir, {.sharded = true});
    ckpt.load(*ckpt.latest_valid(*pg).path, state, *pg);
    const auto full = values_of(model.full_parameters());
    ASSERT_EQ(full.size(), saved[0].size());
    for (size_t i = 0; i < full.size(); ++i) {
      EXPECT_TRUE(torch::equal(full[i], saved[0][i])) << "parameter " << i << ", rank " << r;
    }
  });
  expect_no_errors(errors);
  fs::remove_all(dir);
}

// A CNN with BatchNorm, each layer a Sharded unit: ZeRO-2 and ZeRO-3, world sizes 1-4, one
// micro-batch a step or two (no_sync on the first), fp32 and bf16, against the emulation of what
// DDP computes (BatchNorm's statistics per rank and micro-batch).
struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
    // No bias before BatchNorm (as CNNs have it): its gradient would be rounding noise, which
    // Adam scales up to full steps, so the order of a sum would decide its value.
    conv = register_module("conv", Sharded<torch::nn::Conv2dImpl>(
                                       torch::nn::Conv2dOptions(1, 3, 3).bias(false)));
    bn = register_module("bn", Sharded<torch::nn::BatchNorm2dImpl>(3));
    fc = register_module("fc", Sharded<torch::nn::LinearImpl>(3 * 4 * 4, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc(torch::relu(bn(conv(x))).flatten(1)); }
  Sharded<torch::nn::Conv2dImpl> conv{nullptr};
  Sharded<torch::nn::BatchNorm2dImpl> bn{nullptr};
  Sharded<torch::nn::LinearImpl> fc{nullptr};
};
TORCH_MODULE(ConvNet);

at::Tensor images(int step) {
  std::lock_guard<std::mutex> lock(g_rng);
  torch::manual_seed(77 + 1000 * step);
  return torch::randn({kGlobalBatch, 1, 6, 6});
}

TEST(Fsdp, ACnnWithBatchNormTrainsAsDdpWithAndWithoutAccumulationInFp32AndBf16) {
  for (const bool bf16 : {false, true}) {
    for (const int accum : {1, 2}) {
      const at::ScalarType low = bf16 ? torch::kBFloat16 : torch::kFloat;
      for (int world : {1, 2, 3, 4}) {
        const auto want = emulated<ConvNet>(Opt::kAdam, 31, world, images, accum, low);
        for (ShardingStrategy strategy :
             {ShardingStrategy::kShardGradOp, ShardingStrategy::kFullShard}) {
          SCOPED_TRACE(fmt::format("{}, {}, {} micro-batch(es), world {}",
                                   strategy == ShardingStrategy::kFullShard ? "ZeRO-3" : "ZeRO-2",
                                   bf16 ? "bf16" : "fp32", accum, world));
          std::vector<std::vector<at::Tensor>> got(static_cast<size_t>(world));
          const int port = testing::free_port();
          auto errors = testing::run_threads(world, [&](int r) {
            auto pg = make_process_group(testing::thread_rank(r, world, port));
            ConvNet net = seeded<ConvNet>(r == 0 ? 31 : 400 + r);
            FSDPOptions options{.process_group = pg, .sharding_strategy = strategy};
            if (bf16) {
              options.mixed_precision = {.param_dtype = low,
                                         .reduce_dtype = torch::kFloat,
                                         .buffer_dtype = low};
            }
            FullyShardedDataParallel model(net, options);
            auto opt = make_optimizer(Opt::kAdam, model.parameters());
            const int per_rank = kGlobalBatch / world, per_micro = per_rank / accum;
            for (int s = 0; s < kSteps; ++s) {
              const at::Tensor x = images(s);
              opt->zero_grad();
              for (int m = 0; m < accum; ++m) {
                const FSDPNoSyncGuard no_sync = model.no_sync(/*enabled=*/m + 1 < accum);
                (model(x.narrow(0, r * per_rank + m * per_micro, per_micro)).pow(2).mean() / accum)
                    .backward();
              }
              opt->step();
            }
            got[r] = values_of(model.full_parameters());
            pg->barrier().wait();
          });
          expect_no_errors(errors);
          expect_as_emulated(got, want);
        }
      }
    }
  }
}

TEST(Fsdp, MistakesAreNamed) {
  auto pg = make_process_group(testing::one_rank_options());
  Nested net;
  torch::nn::Linear stranger(2, 2);
  try {
    FullyShardedDataParallel model(net, {.process_group = pg, .units = {stranger.ptr()}});
    ADD_FAILURE() << "a unit outside the module was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("is not a submodule of the wrapped module"),
              std::string::npos)
        << e.what();
  }
  Nested mixed;
  mixed->outer->ptr(1)->to(torch::kDouble);
  try {
    FullyShardedDataParallel model(mixed, {.process_group = pg});
    ADD_FAILURE() << "a unit of float and double was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("need one dtype and device"), std::string::npos)
        << e.what();
  }
  ShardedMlp twice;
  FullyShardedDataParallel first(twice, {.process_group = pg});
  try {
    FullyShardedDataParallel second(twice, {.process_group = pg});
    ADD_FAILURE() << "a Sharded unit was taken by a second wrapper";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("unit 'a' is already in another FullyShardedDataParallel"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(first(torch::randn({2, 6})).sizes(), (std::vector<int64_t>{2, 3}));
  Mlp whole;
  try {
    FullyShardedDataParallel model(whole, {.process_group = pg,
                                           .mixed_precision = {.param_dtype = torch::kInt}});
    ADD_FAILURE() << "an integer param_dtype was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("mixed_precision.param_dtype is Int; it must be a "
                                         "floating-point dtype"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(whole->a->weight.dim(), 2) << "a refused construction left the module as it was";
  Mlp plain;
  try {
    FullyShardedDataParallel model(plain, {.process_group = pg,
                                           .sharding_strategy = ShardingStrategy::kFullShard});
    ADD_FAILURE() << "ZeRO-3 without a Sharded unit was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("needs that forward to pass through ddp::Sharded<M>"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace ddp
