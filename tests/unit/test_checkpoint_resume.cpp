// Checkpoint contents: a round trip restores model, optimizer (SGD with momentum, AdamW),
// sampler and generators bit for bit; a run resumed from step k ends bitwise identical to the
// uninterrupted run; a checkpoint of another model, optimizer or dataset is refused with the
// differences named and nothing modified. Negative controls show the tests can fail.
#include <functional>
#include <memory>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "c10d/compat.h"        // optimizer_state_key
#include "checkpoint/encode.h"  // per-rank generator states without ranks
#include "checkpoint/file_io.h"
#include "checkpoint/state.h"
#include "ddp/checkpoint.h"
#include "ddp/data_loader.h"
#include "ddp/sampler.h"
#include "test_checkpoint_support.h"

namespace ddp {
namespace {

using testing::bitwise_equal;
using testing::Net;
using testing::TempDir;

enum class OptKind { kSgdMomentum, kAdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(OptKind kind, Net& net) {
  if (kind == OptKind::kSgdMomentum) {
    return std::make_unique<torch::optim::SGD>(
        net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
  }
  return std::make_unique<torch::optim::AdamW>(net->parameters(),
                                               torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

// Everything a training run holds.
struct TrainRun {
  TrainRun(OptKind kind, uint64_t init_seed, const std::shared_ptr<TensorDataset>& data)
      : net((torch::manual_seed(init_seed), Net())), opt(make_optimizer(kind, net)),
        sampler(data->size(), {.num_replicas = 1, .rank = 0, .shuffle = true, .seed = 3}),
        loader(data, sampler, {.batch_size = 8}) {}

  CheckpointRefs refs() {
    return {.model = net.get(), .optimizer = opt.get(), .sampler = &sampler};
  }

  Net net;
  std::unique_ptr<torch::optim::Optimizer> opt;
  DistributedSampler sampler;
  DataLoader loader;
  int64_t step = 0;
  int64_t epoch = 0;
};

// A trainer's loop: epochs of loader passes, one optimizer step per batch, stopping after step
// `until`; on_step(run) after every step (where a trainer checkpoints).
void train(TrainRun& r, int64_t until, const std::function<void(TrainRun&)>& on_step = {}) {
  r.net->train();
  while (r.step < until) {
    r.sampler.set_epoch(r.epoch);
    for (auto& b : r.loader) {
      r.opt->zero_grad();
      auto loss = torch::nn::functional::cross_entropy(r.net->forward(b.data), b.target);
      loss.backward();
      r.opt->step();
      ++r.step;
      if (on_step) on_step(r);
      if (r.step == until) break;
    }
    if (r.sampler.position() == r.sampler.num_samples()) ++r.epoch;
  }
}

// How the optimizer keys a parameter's state (a string in LibTorch 1.13, a pointer in 2.x).
ddp::c10d_compat::OptimizerStateKey key_of(const at::Tensor& p) {
  return ddp::c10d_compat::optimizer_state_key(p);
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  return !a.defined() || torch::equal(a, b);
}

// Per-parameter optimizer state and group options, bit for bit.
::testing::AssertionResult same_optimizer_state(OptKind kind, torch::optim::Optimizer& a,
                                                torch::optim::Optimizer& b) {
  const auto pa = a.param_groups()[0].params();
  const auto pb = b.param_groups()[0].params();
  if (a.param_groups()[0].options().get_lr() != b.param_groups()[0].options().get_lr()) {
    return ::testing::AssertionFailure() << "lr differs";
  }
  for (size_t i = 0; i < pa.size(); ++i) {
    const bool ha = a.state().count(key_of(pa[i])), hb = b.state().count(key_of(pb[i]));
    if (ha != hb) return ::testing::AssertionFailure() << "state presence differs at #" << i;
    if (!ha) continue;
    if (kind == OptKind::kSgdMomentum) {
      auto& sa = static_cast<torch::optim::SGDParamState&>(*a.state().at(key_of(pa[i])));
      auto& sb = static_cast<torch::optim::SGDParamState&>(*b.state().at(key_of(pb[i])));
      if (!same(sa.momentum_buffer(), sb.momentum_buffer())) {
        return ::testing::AssertionFailure() << "momentum buffer #" << i << " differs";
      }
    } else {
      auto& sa = static_cast<torch::optim::AdamWParamState&>(*a.state().at(key_of(pa[i])));
      auto& sb = static_cast<torch::optim::AdamWParamState&>(*b.state().at(key_of(pb[i])));
      if (sa.step() != sb.step() || !same(sa.exp_avg(), sb.exp_avg()) ||
          !same(sa.exp_avg_sq(), sb.exp_avg_sq()) ||
          !same(sa.max_exp_avg_sq(), sb.max_exp_avg_sq())) {
        return ::testing::AssertionFailure() << "AdamW state #" << i << " differs";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

bool same_sampler(const SamplerState& a, const SamplerState& b) {
  return a.epoch == b.epoch && a.position == b.position && a.num_replicas == b.num_replicas &&
         a.offset == b.offset && a.dataset_size == b.dataset_size && a.seed == b.seed &&
         a.shuffle == b.shuffle && a.drop_last == b.drop_last && a.pad == b.pad;
}

class CheckpointRoundTrip : public ::testing::TestWithParam<OptKind> {};

TEST_P(CheckpointRoundTrip, RestoresModelOptimizerSamplerBitwise) {
  const OptKind kind = GetParam();
  TempDir dir;
  auto data = testing::make_dataset(44);
  TrainRun a(kind, /*init_seed=*/1, data);
  train(a, 9);  // mid-epoch 1: momentum / moments are non-trivial, the cursor is mid-pass
  a.opt->param_groups()[0].options().set_lr(0.0123);  // as a scheduler would have set it
  save_checkpoint(dir / "a.ckpt", a.refs(),
                  {.step = a.step,
                   .epoch = a.epoch,
                   .hparams_json = R"({"lr": 0.05})",
                   .blob = std::string("sched\0state", 11)});

  TrainRun b(kind, /*init_seed=*/2, data);  // another initialisation, no state at all
  ASSERT_FALSE(bitwise_equal(*a.net, *b.net));
  const LoadedCheckpoint got = load_checkpoint(dir / "a.ckpt", b.refs());
  EXPECT_TRUE(bitwise_equal(*a.net, *b.net));
  EXPECT_TRUE(same_optimizer_state(kind, *a.opt, *b.opt));
  EXPECT_TRUE(same_sampler(a.sampler.state(), b.sampler.state()));
  EXPECT_EQ(got.meta.step, 9);
  EXPECT_EQ(got.meta.epoch, 1);
  EXPECT_EQ(got.meta.blob, std::string("sched\0state", 11));
  EXPECT_EQ(got.meta.hparams_json, R"({"lr":0.05})");
  EXPECT_EQ(got.meta.world_size, 1);
  EXPECT_FALSE(got.world_size_changed);
  EXPECT_TRUE(got.rng_exact);
  EXPECT_EQ(got.meta.optimizer_type,
            kind == OptKind::kSgdMomentum ? "torch::optim::SGD" : "torch::optim::AdamW");

  // The same next step on both (same batch, same dropout mask): still bitwise identical.
  // They share the process's generator, so each starts from the restored state.
  b.step = a.step;
  b.epoch = a.epoch;
  auto gen = at::detail::getDefaultCPUGenerator();
  const at::Tensor rng = gen.get_state();
  train(a, 10);
  gen.set_state(rng);
  train(b, 10);
  EXPECT_TRUE(bitwise_equal(*a.net, *b.net));
  EXPECT_TRUE(same_optimizer_state(kind, *a.opt, *b.opt));
}

TEST_P(CheckpointRoundTrip, LoadReplacesTheOptimizerStateEntirely) {
  // Saved before the first step (no per-parameter state); loaded into an optimizer that has
  // stepped: afterwards it holds no state either, as the saved run did.
  const OptKind kind = GetParam();
  TempDir dir;
  auto data = testing::make_dataset(44);
  TrainRun a(kind, 1, data);
  save_checkpoint(dir / "zero.ckpt", a.refs(), {});
  TrainRun b(kind, 2, data);
  train(b, 2);
  ASSERT_FALSE(b.opt->state().empty());
  load_checkpoint(dir / "zero.ckpt", b.refs());
  EXPECT_TRUE(b.opt->state().empty());
  EXPECT_TRUE(same_optimizer_state(kind, *a.opt, *b.opt));
}

// Exact resume: checkpoint at k inside an uninterrupted run to N; a second run (other init,
// other RNG) restores k and continues to N. Both end bitwise identical: parameters, buffers,
// optimizer state, sampler cursor, and the generator (the next draw).
void expect_exact_resume(OptKind kind, int64_t k, int64_t n) {
  SCOPED_TRACE(::testing::Message() << "k=" << k << " n=" << n);
  TempDir dir;
  auto data = testing::make_dataset(44);  // 6 batches of 8 per epoch, the last of 4
  Checkpointer ckpt(dir.path(), {.keep = 0});
  TrainRun a(kind, 1, data);
  train(a, n, [&](TrainRun& r) {
    if (r.step == k) ckpt.save(r.refs(), {.step = r.step, .epoch = r.epoch});
  });

  TrainRun b(kind, 2, data);
  torch::manual_seed(12345);  // a fresh process would not share a's generator state
  const ResumePoint resume = ckpt.latest_valid();
  ASSERT_TRUE(resume.path.has_value());
  const LoadedCheckpoint got = ckpt.load(*resume.path, b.refs());
  b.step = got.meta.step;
  b.epoch = got.meta.epoch;
  ASSERT_EQ(b.step, k);
  train(b, n);

  EXPECT_TRUE(bitwise_equal(*a.net, *b.net));
  EXPECT_TRUE(same_optimizer_state(kind, *a.opt, *b.opt));
  EXPECT_TRUE(same_sampler(a.sampler.state(), b.sampler.state()));
  EXPECT_EQ(a.epoch, b.epoch);
}

TEST_P(CheckpointRoundTrip, ResumedRunEqualsUninterruptedRun) {
  for (int64_t k : {3, 6, 13}) expect_exact_resume(GetParam(), k, 20);  // mid, end, later epoch
}

INSTANTIATE_TEST_SUITE_P(Optimizers, CheckpointRoundTrip,
                         ::testing::Values(OptKind::kSgdMomentum, OptKind::kAdamW),
                         [](const auto& info) {
                           return info.param == OptKind::kSgdMomentum ? "SgdMomentum" : "AdamW";
                         });

// Negative controls: leave out one part of the state and the resumed run diverges, so the
// exact-resume test above would catch a checkpoint that forgot it.
TEST(CheckpointResume, WithoutRngOrOptimizerTheRunDiverges) {
  TempDir dir;
  auto data = testing::make_dataset(44);
  TrainRun a(OptKind::kSgdMomentum, 1, data);
  train(a, 10, [&](TrainRun& r) {
    if (r.step == 5) save_checkpoint(dir / "k.ckpt", r.refs(), {.step = 5, .epoch = r.epoch});
  });
  for (int leave_out = 0; leave_out < 2; ++leave_out) {
    TrainRun b(OptKind::kSgdMomentum, 2, data);
    torch::manual_seed(12345);
    CheckpointRefs refs = b.refs();
    if (leave_out == 0) refs.rng = false;
    if (leave_out == 1) refs.optimizer = nullptr;  // b.opt keeps empty momentum buffers
    const auto got = load_checkpoint(dir / "k.ckpt", refs);
    b.step = got.meta.step;
    b.epoch = got.meta.epoch;
    train(b, 10);
    EXPECT_FALSE(bitwise_equal(*a.net, *b.net)) << "left out " << (leave_out ? "optimizer" : "rng");
  }
}

// A mix of draws: uniform, scalar normals (the path that may cache a second Box-Muller value),
// a long normal vector, Bernoulli (dropout), integers, a permutation.
std::vector<at::Tensor> draws() {
  return {torch::rand({7}),
          torch::randn({1}),
          torch::randn({1}),
          torch::randn({1000}),
          torch::bernoulli(torch::full({64}, 0.3)),
          torch::randint(0, 1000, {5}),
          torch::randperm(20)};
}

TEST(CheckpointRng, StreamContinuesIdenticallyAfterRestore) {
  TempDir dir;
  Net net;
  torch::manual_seed(42);
  torch::randn({1});  // an odd number of scalar normals drawn before the save
  torch::rand({3});
  save_checkpoint(dir / "rng.ckpt", {.model = net.get()}, {});
  const auto expected = draws();  // the uninterrupted run's next numbers

  torch::manual_seed(999);
  draws();
  load_checkpoint(dir / "rng.ckpt", {.model = net.get()});
  const auto got = draws();
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << i;

  // Negative control: rng = false leaves the generator alone, and the numbers differ.
  torch::manual_seed(999);
  load_checkpoint(dir / "rng.ckpt", {.model = net.get(), .rng = false});
  EXPECT_FALSE(torch::equal(torch::rand({7}), expected[0]));
}

TEST(CheckpointRng, EachRankTakesItsOwnState) {
  // Three ranks with different generator states (per-rank seeds), as a collective save
  // gathers them; built with the internal encoder since threads share one generator.
  TempDir dir;
  Net net;
  std::vector<std::string> states;
  std::vector<at::Tensor> next;
  for (int r = 0; r < 3; ++r) {
    torch::manual_seed(100 + r);
    states.push_back(ckpt::capture_rng());
    next.push_back(torch::rand({4}));
  }
  const ckpt::Encoded e =
      ckpt::encode_checkpoint({.model = net.get()}, {.world_size = 3}, states, {});
  ckpt::write_atomic(dir / "ranks.ckpt", {e.head, e.payload}, {});

  for (int r = 0; r < 3; ++r) {
    torch::manual_seed(7);
    const auto got =
        load_checkpoint(dir / "ranks.ckpt", {.model = net.get()}, {.rank = r, .world_size = 3});
    EXPECT_TRUE(torch::equal(torch::rand({4}), next[r])) << "rank " << r;
    EXPECT_TRUE(got.rng_exact);
    EXPECT_FALSE(got.world_size_changed);
  }
  // At world size 5, rank 4 takes rank 4 % 3 = 1's state, and it is reported as inexact.
  const auto got =
      load_checkpoint(dir / "ranks.ckpt", {.model = net.get()}, {.rank = 4, .world_size = 5});
  EXPECT_TRUE(torch::equal(torch::rand({4}), next[1]));
  EXPECT_FALSE(got.rng_exact);
  EXPECT_TRUE(got.world_size_changed);
  EXPECT_EQ(got.meta.world_size, 3);
}

TEST(CheckpointSampler, StateRoundTripsAndAnotherDatasetIsRefused) {
  TempDir dir;
  Net net;
  DistributedSampler s(50, {.num_replicas = 1, .rank = 0, .seed = 9});
  s.set_epoch(3);
  s.advance(17);
  save_checkpoint(dir / "s.ckpt", {.model = net.get(), .sampler = &s}, {.epoch = 3});

  DistributedSampler t(50, {.num_replicas = 1, .rank = 0, .seed = 9});
  const auto got = load_checkpoint(dir / "s.ckpt", {.model = net.get(), .sampler = &t});
  EXPECT_TRUE(same_sampler(s.state(), t.state()));
  EXPECT_EQ(t.remaining(), s.remaining());
  ASSERT_TRUE(got.meta.sampler.has_value());
  EXPECT_EQ(got.meta.sampler->position, 17);

  DistributedSampler other(51, {.num_replicas = 1, .rank = 0, .seed = 9});
  const auto net_before = testing::snapshot(*net);
  try {
    load_checkpoint(dir / "s.ckpt", {.model = net.get(), .sampler = &other});
    ADD_FAILURE() << "a sampler over another dataset was accepted";
  } catch (const IncompatibleCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("sampler state does not fit"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(other.epoch(), 0);
  EXPECT_EQ(other.position(), 0);
  EXPECT_TRUE(testing::same_as_snapshot(*net, net_before));
}

// --- refusing a checkpoint that does not fit -----------------------------------------------

std::string load_error(const std::filesystem::path& file, const CheckpointRefs& refs,
                       const LoadOptions& options = {}) {
  try {
    load_checkpoint(file, refs, options);
  } catch (const IncompatibleCheckpointError& e) {
    return e.what();
  }
  return "(no IncompatibleCheckpointError)";
}

TEST(CheckpointMismatch, AnotherModelIsRefusedNamingTheDifferences) {
  TempDir dir;
  Net small(32);
  torch::optim::SGD opt(small->parameters(), 0.1);
  save_checkpoint(dir / "mlp.ckpt", {.model = small.get(), .optimizer = &opt},
                  {.model_label = "--model mlp"});

  Net wide(64);
  torch::optim::SGD wide_opt(wide->parameters(), 0.1);
  const auto before = testing::snapshot(*wide);
  const std::string msg =
      load_error(dir / "mlp.ckpt", {.model = wide.get(), .optimizer = &wide_opt},
                 {.model_label = "--model mlp-wide"});
  EXPECT_NE(msg.find((dir / "mlp.ckpt").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("checkpoint holds parameter 'fc1.weight' [32, 20] but the model has [64, 20]"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("buffer 'bn.running_mean' [32] but the model has [64]"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("it was written by --model mlp, this run is --model mlp-wide"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(testing::same_as_snapshot(*wide, before));  // refused before touching anything

  // A model of another architecture: parameters missing on either side.
  struct OtherImpl : torch::nn::Module {
    OtherImpl() {
      conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    }
    torch::nn::Conv2d conv1{nullptr};
  };
  auto other = std::make_shared<OtherImpl>();
  const std::string msg2 =
      load_error(dir / "mlp.ckpt", {.model = other.get()}, {.model_label = "--model cnn"});
  EXPECT_NE(msg2.find("checkpoint holds parameter 'fc1.weight' [32, 20] that the model lacks"),
            std::string::npos)
      << msg2;
  EXPECT_NE(msg2.find("the model has parameter 'conv1.weight' [4, 1, 3, 3] that the checkpoint "
                      "lacks"),
            std::string::npos)
      << msg2;
  EXPECT_NE(msg2.find("it was written by --model mlp, this run is --model cnn"), std::string::npos)
      << msg2;

  // Same tensors, another dtype.
  Net dbl(32);
  dbl->to(torch::kDouble);
  const std::string msg3 = load_error(dir / "mlp.ckpt", {.model = dbl.get()});
  EXPECT_NE(msg3.find("checkpoint holds parameter 'fc1.weight' as Float but the model has Double"),
            std::string::npos)
      << msg3;
}

TEST(CheckpointMismatch, AnotherOptimizerIsRefused) {
  TempDir dir;
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  save_checkpoint(dir / "sgd.ckpt", {.model = net.get(), .optimizer = &sgd}, {});
  save_checkpoint(dir / "none.ckpt", {.model = net.get()}, {});

  torch::optim::AdamW adamw(net->parameters());
  EXPECT_NE(load_error(dir / "sgd.ckpt", {.model = net.get(), .optimizer = &adamw})
                .find("holds torch::optim::SGD state but this run's optimizer is "
                      "torch::optim::AdamW"),
            std::string::npos);
  EXPECT_NE(load_error(dir / "none.ckpt", {.model = net.get(), .optimizer = &sgd})
                .find("holds no optimizer state"),
            std::string::npos);
  // Another split into param groups.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto params = net->parameters();
  groups.emplace_back(std::vector<at::Tensor>(params.begin(), params.begin() + 2));
  groups.emplace_back(std::vector<at::Tensor>(params.begin() + 2, params.end()));
  torch::optim::SGD split(groups, torch::optim::SGDOptions(0.1));
  EXPECT_NE(load_error(dir / "sgd.ckpt", {.model = net.get(), .optimizer = &split})
                .find("param groups of [6] parameters, this run's has [2, 4]"),
            std::string::npos);
}

TEST(CheckpointMeta, WorldSizeChangeIsReported) {
  TempDir dir;
  Net net;
  save_checkpoint(dir / "w4.ckpt", {.model = net.get()}, {.step = 5, .world_size = 4});
  const CheckpointMeta m = read_checkpoint_meta(dir / "w4.ckpt");
  EXPECT_EQ(m.world_size, 4);
  EXPECT_EQ(m.step, 5);
  EXPECT_EQ(m.rng_states, 1);
  EXPECT_GT(m.num_threads, 0);
  const auto got = load_checkpoint(dir / "w4.ckpt", {.model = net.get()});
  EXPECT_TRUE(got.world_size_changed);
  EXPECT_FALSE(got.rng_exact);
}

TEST(CheckpointMeta, BadArgumentsAreConfigErrors) {
  TempDir dir;
  Net net;
  EXPECT_THROW(save_checkpoint(dir / "x.ckpt", {}, {}), ConfigError);
  EXPECT_THROW(save_checkpoint(dir / "x.ckpt", {.model = net.get()}, {.hparams_json = "{lr"}),
               ConfigError);
  EXPECT_FALSE(std::filesystem::exists(dir / "x.ckpt"));
}

}  // namespace
}  // namespace ddp
