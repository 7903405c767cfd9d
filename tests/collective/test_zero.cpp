// ZeroRedundancyOptimizer (Notes [ZeRO-1], [ZeRO checkpoints]) with ranks as threads: each
// rank steps only its shard, yet every parameter equals an unsharded optimizer's after every
// step, at world sizes 1 to 4, for SGD with momentum and AdamW; the state is split by the world
// size; a checkpoint resumes bitwise at the same size and, consolidated, at any other.
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "ddp/comm_hooks.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/zero_redundancy_optimizer.h"
#include "support/ranks.h"

namespace {

using ddp::ProcessGroup;
using ddp::ZeroRedundancyOptimizer;

// A small MLP's parameters (784-64-32-10 as plain tensors) and a gradient per step, made once
// on the main thread: every rank starts from copies and sees the same gradients, as after DDP's
// all-reduce.
struct Problem {
  std::vector<at::Tensor> init;
  std::vector<std::vector<at::Tensor>> grads;  // [step][param]
};

Problem make_problem(int steps) {
  torch::manual_seed(7);
  Problem p;
  for (auto shape : std::vector<std::vector<int64_t>>{{64, 784}, {64}, {32, 64}, {32}, {10, 32},
                                                      {10}}) {
    p.init.push_back(torch::randn(shape) * 0.1);
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<at::Tensor> g;
    for (const at::Tensor& t : p.init) g.push_back(torch::randn_like(t));
    p.grads.push_back(std::move(g));
  }
  return p;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& from) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : from) out.push_back(t.clone().set_requires_grad(true));
  return out;
}

void set_grads(std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
}

enum class Kind { kSgd, kAdamW };
const char* name(Kind k) { return k == Kind::kSgd ? "SGD(momentum 0.9)" : "AdamW"; }

const auto kSgdOptions = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3);
const auto kAdamWOptions = torch::optim::AdamWOptions(1e-3).weight_decay(1e-2);

ZeroRedundancyOptimizer make_zero(Kind k, std::vector<at::Tensor> params,
                                  std::shared_ptr<ProcessGroup> pg,
                                  ddp::ZeroOptions options = {}) {
  if (k == Kind::kSgd) {
    return ZeroRedundancyOptimizer::make<torch::optim::SGD>(std::move(params), kSgdOptions,
                                                            std::move(pg), options);
  }
  return ZeroRedundancyOptimizer::make<torch::optim::AdamW>(std::move(params), kAdamWOptions,
                                                            std::move(pg), options);
}

std::unique_ptr<torch::optim::Optimizer> unsharded(Kind k, std::vector<at::Tensor> params) {
  if (k == Kind::kSgd) return std::make_unique<torch::optim::SGD>(std::move(params), kSgdOptions);
  return std::make_unique<torch::optim::AdamW>(std::move(params), kAdamWOptions);
}

// The unsharded optimizer on one replica: the reference after each of `steps` steps.
std::vector<std::vector<at::Tensor>> reference(Kind k, const Problem& p, int steps) {
  std::vector<at::Tensor> params = copies(p.init);
  std::unique_ptr<torch::optim::Optimizer> opt = unsharded(k, params);
  std::vector<std::vector<at::Tensor>> after;
  for (int s = 0; s < steps; ++s) {
    set_grads(params, p.grads[s]);
    opt->step();
    std::vector<at::Tensor> snap;
    for (const at::Tensor& t : params) snap.push_back(t.detach().clone());
    after.push_back(std::move(snap));
  }
  return after;
}

// Runs `steps` steps from `from` on `world` thread-ranks; `before` runs on each rank after the
// optimizer is made (to load a state), `after` at the end (to save one).
using Hook = std::function<void(int rank, ZeroRedundancyOptimizer&)>;
std::vector<std::vector<at::Tensor>> run_zero(Kind k, const Problem& p, int world, int first,
                                              int steps, const std::vector<at::Tensor>& from,
                                              const Hook& before = nullptr,
                                              const Hook& after = nullptr) {
  std::vector<std::vector<at::Tensor>> finals(static_cast<size_t>(world));
  const int port = ddp::testing::free_port();
  auto errors = ddp::testing::run_threads(world, [&](int r) {
    auto pg = ddp::make_process_group(ddp::testing::thread_rank(r, world, port));
    std::vector<at::Tensor> params = copies(from);
    ZeroRedundancyOptimizer zero = make_zero(k, params, pg);
    if (before) before(r, zero);
    for (int s = first; s < first + steps; ++s) {
      set_grads(params, p.grads[s]);
      zero.step();
      zero.zero_grad();
    }
    if (after) after(r, zero);
    for (const at::Tensor& t : params) finals[r].push_back(t.detach().clone());
    pg->barrier().wait();
  });
  for (int r = 0; r < world; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << ddp::testing::message_of(errors[r]);
  }
  return finals;
}

void expect_equal(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::equal(got[i], want[i]))
        << what << ": parameter " << i << " differs, max |diff| "
        << (got[i] - want[i]).abs().max().item<double>();
  }
}

// PyTorch's partition: largest first, each to the least loaded rank (the first of equals).
TEST(Zero, PartitionsAsPyTorchDoes) {
  std::vector<at::Tensor> params;
  for (int64_t n : {100, 10, 50, 50, 1, 200}) params.push_back(torch::zeros({n}));
  std::mutex mu;
  std::vector<std::vector<int>> owners(3);
  ddp::testing::run_ranks(3, [&](ProcessGroup& pg) {
    std::shared_ptr<ProcessGroup> shared(&pg, [](ProcessGroup*) {});
    ZeroRedundancyOptimizer zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(
        copies(params), torch::optim::SGDOptions(0.1), shared);
    std::vector<int> o;
    for (size_t i = 0; i < params.size(); ++i) o.push_back(zero.owner(i));
    std::lock_guard<std::mutex> lock(mu);
    owners[pg.rank()] = o;
    for (size_t i : zero.owned()) EXPECT_EQ(zero.owner(i), pg.rank());
  });
  // 200 -> 0; 100 -> 1; 50 -> 2; 50 -> 2 (50 < 100); 10 -> 1 (100 = 100: the first); 1 -> 2.
  const std::vector<int> want = {1, 1, 2, 2, 2, 0};
  for (int r = 0; r < 3; ++r) EXPECT_EQ(owners[r], want) << "rank " << r;
}

TEST(Zero, EveryStepEqualsTheUnshardedOptimizer) {
  constexpr int kSteps = 6;
  const Problem p = make_problem(kSteps);
  for (Kind k : {Kind::kSgd, Kind::kAdamW}) {
    const auto want = reference(k, p, kSteps);
    for (int world : {1, 2, 3, 4}) {
      const auto got = run_zero(k, p, world, 0, kSteps, p.init);
      for (int r = 0; r < world; ++r) {
        expect_equal(got[r], want.back(),
                     fmt::format("{}, world {}, rank {} after {} steps", name(k), world, r,
                                 kSteps));
      }
    }
  }
}

// The state exists once in the job: each rank holds about 1/world of it, within one
// parameter's state of an even split.
TEST(Zero, OptimizerStateIsSplitByTheWorldSize) {
  const Problem p = make_problem(1);
  int64_t largest = 0;
  for (const at::Tensor& t : p.init) largest = std::max<int64_t>(largest, t.nbytes());
  int64_t whole = 0;
  for (int world : {1, 2, 4}) {
    std::vector<int64_t> bytes(static_cast<size_t>(world));
    run_zero(Kind::kAdamW, p, world, 0, 1, p.init, nullptr,
             [&](int r, ZeroRedundancyOptimizer& z) { bytes[r] = z.state_bytes(); });
    int64_t total = 0;
    for (int64_t b : bytes) total += b;
    if (world == 1) whole = total;
    EXPECT_EQ(total, whole) << "world " << world;
    const int64_t most = *std::max_element(bytes.begin(), bytes.end());
    EXPECT_LE(most, whole / world + 2 * largest) << "world " << world;  // AdamW: 2 moments
    std::printf("[ measured ] AdamW state per rank at world %d: %s bytes (of %lld)\n", world,
                fmt::format("{}", fmt::join(bytes, ", ")).c_str(),
                static_cast<long long>(whole));
  }
  EXPECT_GT(whole, 0);
}

// Note [ZeRO checkpoints]: the shard resumes bitwise at the same size; the consolidated state
// resumes at any size; a shard at another size is refused, naming what is missing.
TEST(Zero, CheckpointsResumeBitwiseAtTheSameSizeAndConsolidatedAtAnother) {
  constexpr int kSteps = 6, kCut = 3, kWorld = 3;
  const Problem p = make_problem(kSteps);
  for (Kind k : {Kind::kSgd, Kind::kAdamW}) {
    SCOPED_TRACE(name(k));
    const auto want = reference(k, p, kSteps);
    std::vector<std::string> shards(kWorld);
    std::string consolidated;
    const auto cut = run_zero(k, p, kWorld, 0, kCut, p.init, nullptr,
                              [&](int r, ZeroRedundancyOptimizer& z) {
                                shards[r] = z.shard_state();
                                EXPECT_THROW(z.state_dict(), ddp::Error);
                                z.consolidate_state_dict(0);
                                if (r == 0) {
                                  consolidated = z.state_dict();
                                } else {
                                  EXPECT_THROW(z.state_dict(), ddp::Error);
                                }
                                // Training on drops the consolidated copy.
                                z.step();
                                EXPECT_THROW(z.state_dict(), ddp::Error);
                              });
    ASSERT_FALSE(consolidated.empty());
    const std::vector<at::Tensor>& at_cut = cut[0];
    // Same size, each rank its own shard.
    auto same = run_zero(k, p, kWorld, kCut, kSteps - kCut, at_cut,
                         [&](int r, ZeroRedundancyOptimizer& z) { z.load_state_dict(shards[r]); });
    for (int r = 0; r < kWorld; ++r) expect_equal(same[r], want.back(), "same size, shards");
    // Other sizes, the consolidated state.
    for (int world : {1, 2, 4}) {
      auto other = run_zero(k, p, world, kCut, kSteps - kCut, at_cut,
                            [&](int, ZeroRedundancyOptimizer& z) {
                              z.load_state_dict(consolidated);
                            });
      for (int r = 0; r < world; ++r) {
        expect_equal(other[r], want.back(), fmt::format("consolidated, resumed at world {}", world));
      }
    }
    // A shard at another size: refused.
    std::vector<std::string> errors(2);
    run_zero(k, p, 2, kCut, 0, at_cut, [&](int r, ZeroRedundancyOptimizer& z) {
      try {
        z.load_state_dict(shards[r]);
      } catch (const ddp::Error& e) {
        errors[r] = e.what();
      }
    });
    const std::string all = errors[0] + errors[1];
    EXPECT_NE(all.find("the state does not cover parameter"), std::string::npos) << all;
    EXPECT_NE(all.find("load the consolidated state"), std::string::npos) << all;
  }
}

TEST(Zero, BadStatesAndCallsAreClearErrors) {
  const Problem p = make_problem(1);
  std::string other_model;
  {
    std::vector<at::Tensor> few = {torch::zeros({3}).set_requires_grad(true)};
    auto one = ddp::testing::one_rank_group();
    ZeroRedundancyOptimizer z = ZeroRedundancyOptimizer::make<torch::optim::SGD>(
        few, torch::optim::SGDOptions(0.1), one);
    other_model = z.shard_state();
  }
  auto one = ddp::testing::one_rank_group();
  ZeroRedundancyOptimizer z = make_zero(Kind::kAdamW, copies(p.init), one);
  try {
    z.load_state_dict(other_model);
    ADD_FAILURE() << "loaded another model's state";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the state is of 1 parameters, this optimizer has 6"),
              std::string::npos) << e.what();
  }
  EXPECT_ANY_THROW(z.load_state_dict("not a state"));
  try {
    z.consolidate_state_dict(3);
    ADD_FAILURE() << "consolidated on a rank that does not exist";
  } catch (const ddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3 is not in the group"), std::string::npos);
  }
  EXPECT_THROW(ZeroRedundancyOptimizer::make<torch::optim::SGD>(
                   std::vector<at::Tensor>{}, torch::optim::SGDOptions(0.1), one),
               ddp::ConfigError);
  // set_lr reaches the shard's optimizer.
  z.set_lr(0.5);
  EXPECT_DOUBLE_EQ(z.lr(), 0.5);
  EXPECT_DOUBLE_EQ(z.optimizer()->param_groups().front().options().get_lr(), 0.5);
}

}  // namespace

// Note [ZeRO overlapped with DDP]: with overlap_with_ddp the bucket owners step inside DDP's
// hook; after the two iterations without update, every parameter on every rank equals, bit for
// bit, DDP with an unsharded optimizer that skips its first two steps; a run resumed from a
// consolidated checkpoint (new DDP with the saved bucket order, new optimizer) ends with the
// same bytes. Three buckets (a 100-byte cap), different data per rank, world sizes 2 and 3, SGD
// with momentum and AdamW.
namespace overlap {

// Thread-ranks share LibTorch's global generator: the initial weights and every batch are made
// here, on the main thread, and each rank copies them.
struct Setup {
  std::vector<at::Tensor> init;
  std::vector<std::vector<at::Tensor>> batches;  // [step][rank]
};

torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 4));
}

Setup make_setup(int world, int steps) {
  torch::manual_seed(3);
  Setup s;
  for (const at::Tensor& p : make_net()->parameters()) s.init.push_back(p.detach().clone());
  for (int step = 0; step < steps; ++step) {
    std::vector<at::Tensor> per_rank;
    for (int r = 0; r < world; ++r) per_rank.push_back(torch::randn({8, 20}));
    s.batches.push_back(std::move(per_rank));
  }
  return s;
}

torch::nn::Sequential net_from(const Setup& s) {
  auto net = make_net();
  torch::NoGradGuard no_grad;
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(s.init[i]);
  return net;
}

ddp::DDPOptions ddp_options(std::shared_ptr<ProcessGroup> pg) {
  return {.process_group = std::move(pg), .bucket_cap_mb = 0.0001, .first_bucket_mb = 0.0001};
}

std::vector<at::Tensor> snapshot(torch::nn::Sequential& net) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace overlap

TEST(Zero, OverlapWithDdpEqualsDdpWithTheUnshardedOptimizer) {
  constexpr int kSteps = 6;
  for (Kind k : {Kind::kSgd, Kind::kAdamW}) {
    for (int world : {2, 3}) {
      const overlap::Setup setup = overlap::make_setup(world, kSteps);
      std::vector<std::vector<at::Tensor>> want(world), got(world), got_resumed(world);
      std::vector<int64_t> state_bytes(world);
      constexpr int kCut = 4;  // a checkpoint before step 4 (two updates in)
      std::mutex mu;
      std::string consolidated;
      const int port = ddp::testing::free_port();
      auto errors = ddp::testing::run_threads(world, [&](int r) {
        auto pg = ddp::make_process_group(ddp::testing::thread_rank(r, world, port));
        {  // DDP with the unsharded optimizer, no update in steps 0 and 1
          auto net = overlap::net_from(setup);
          ddp::DistributedDataParallel model(net.ptr(), overlap::ddp_options(pg));
          std::unique_ptr<torch::optim::Optimizer> opt = unsharded(k, net->parameters());
          for (int s = 0; s < kSteps; ++s) {
            opt->zero_grad();
            model(setup.batches[s][r]).pow(2).mean().backward();
            if (s >= 2) opt->step();
          }
          want[r] = overlap::snapshot(net);
        }
        auto net = overlap::net_from(setup);
        ddp::DistributedDataParallel model(net.ptr(), overlap::ddp_options(pg));
        const ddp::ZeroOptions overlapped{.overlap_with_ddp = true};
        auto zero = std::make_shared<ZeroRedundancyOptimizer>(
            make_zero(k, net->parameters(), pg, overlapped));
        // step() before the hook: the option says the hook steps.
        EXPECT_THROW(zero->step(), ddp::ConfigError);
        model.register_comm_hook(
            ddp::comm_hooks::hook_with_zero_step(ddp::comm_hooks::allreduce(), zero));
        std::vector<at::Tensor> params_at_cut;
        std::vector<int64_t> order;
        for (int s = 0; s < kSteps; ++s) {
          if (s == kCut) {  // a checkpoint: the consolidated state, DDP's buckets, the weights
            zero->consolidate_state_dict(0);
            if (r == 0) {
              std::lock_guard<std::mutex> lock(mu);
              consolidated = zero->state_dict();
            }
            params_at_cut = overlap::snapshot(net);
            order = model.bucket_order();
          }
          zero->zero_grad();
          model(setup.batches[s][r]).pow(2).mean().backward();
          zero->step();  // nothing: the hook stepped
        }
        got[r] = overlap::snapshot(net);
        state_bytes[r] = zero->state_bytes();
        pg->barrier().wait();

        // Resumed from the checkpoint in a new DDP and optimizer: the same bytes at the end.
        auto again = overlap::make_net();
        {
          torch::NoGradGuard no_grad;
          auto params = again->parameters();
          for (size_t i = 0; i < params.size(); ++i) params[i].copy_(params_at_cut[i]);
        }
        ddp::DistributedDataParallel resumed(again.ptr(), overlap::ddp_options(pg));
        resumed.restore_bucket_order(order);
        auto zero2 = std::make_shared<ZeroRedundancyOptimizer>(
            make_zero(k, again->parameters(), pg, overlapped));
        {
          std::lock_guard<std::mutex> lock(mu);
          zero2->load_state_dict(consolidated);
        }
        resumed.register_comm_hook(
            ddp::comm_hooks::hook_with_zero_step(ddp::comm_hooks::allreduce(), zero2));
        for (int s = kCut; s < kSteps; ++s) {
          zero2->zero_grad();
          resumed(setup.batches[s][r]).pow(2).mean().backward();
        }
        got_resumed[r] = overlap::snapshot(again);
        pg->barrier().wait();
      });
      for (int r = 0; r < world; ++r) {
        if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << ddp::testing::message_of(errors[r]);
      }
      if (::testing::Test::HasFailure()) return;
      for (int r = 0; r < world; ++r) {
        expect_equal(got[r], want[r], fmt::format("{}, world {}, rank {}", name(k), world, r));
        expect_equal(got[r], got[0], fmt::format("{}, world {}, rank {} vs 0", name(k), world, r));
        expect_equal(got_resumed[r], got[r],
                     fmt::format("{}, world {}, rank {}, resumed", name(k), world, r));
      }
      // The state exists once: every rank holds some, together as much as one unsharded
      // optimizer (SGD: a momentum per element; AdamW: two moments, 4 bytes each).
      int64_t total = 0, elements = 0;
      for (int r = 0; r < world; ++r) {
        EXPECT_GT(state_bytes[r], 0) << name(k) << ", world " << world << ", rank " << r;
        total += state_bytes[r];
      }
      for (const at::Tensor& p : got[0]) elements += p.numel();
      EXPECT_EQ(total, elements * 4 * (k == Kind::kSgd ? 1 : 2)) << name(k) << ", world " << world;
    }
  }
}

// The option and the hook belong together: the hook refuses an optimizer made without it. At
// world size 1 (DDP calls no hook) an optimizer made with it steps in step().
TEST(Zero, HookWithZeroStepNeedsTheOverlapOption) {
  auto errors = ddp::testing::run_threads(1, [&](int r) {
    auto pg = ddp::make_process_group(ddp::testing::thread_rank(r, 1, ddp::testing::free_port()));
    auto net = overlap::make_net();
    {
      auto params = net->parameters();
      auto alone = std::make_shared<ZeroRedundancyOptimizer>(
          ZeroRedundancyOptimizer::make<torch::optim::SGD>(
              params, torch::optim::SGDOptions(0.1), pg,
              ddp::ZeroOptions{.overlap_with_ddp = true}));
      ddp::comm_hooks::hook_with_zero_step(ddp::comm_hooks::allreduce(), alone);
      const at::Tensor before = params[0].detach().clone();
      for (at::Tensor& p : params) p.mutable_grad() = torch::ones_like(p);
      alone->step();
      EXPECT_TRUE(torch::allclose(params[0].detach(), before - 0.1)) << "world 1 did not step";
    }
    auto plain = std::make_shared<ZeroRedundancyOptimizer>(
        make_zero(Kind::kSgd, net->parameters(), pg));
    try {
      ddp::comm_hooks::hook_with_zero_step(ddp::comm_hooks::allreduce(), plain);
      ADD_FAILURE() << "no error";
    } catch (const ddp::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("made without ZeroOptions{.overlap_with_ddp = true}"),
                std::string::npos)
          << e.what();
    }
  });
  if (errors[0]) ADD_FAILURE() << ddp::testing::message_of(errors[0]);
}
