// Checkpoint contents through TrainingState: a round trip restores model, optimizer (SGD with
// momentum, AdamW), sampler and generators bit for bit; a run resumed from step k ends bitwise
// identical to the uninterrupted run; a user's own Stateful round-trips; a checkpoint of another
// model, optimizer or dataset is refused with the differences named and nothing modified.
// Negative controls show the tests can fail.
#include <functional>
#include <memory>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "c10d/compat.h"  // optimizer_state_key
#include "ddp/checkpoint.h"
#include "ddp/data_loader.h"
#include "ddp/sampler.h"
#include "state/group_bound.h"  // what ft::Manager moves to each quorum
#include "support/ranks.h"      // one_rank_group
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

  // What a checkpoint of this run holds; `rng` and `optimizer`: leave them out when false.
  TrainingState state(bool rng = true, bool optimizer = true) {
    TrainingState s;
    s.add("model", net);
    if (optimizer) s.add("optimizer", *opt);
    s.add("sampler", sampler);
    if (rng) s.add("rng", default_generators());
    return s;
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
  TrainingState saved = a.state();
  save_checkpoint(dir / "a.ckpt", saved,
                  {.step = a.step, .epoch = a.epoch, .hparams_json = R"({"lr": 0.05})"});

  TrainRun b(kind, /*init_seed=*/2, data);  // another initialisation, no state at all
  ASSERT_FALSE(bitwise_equal(*a.net, *b.net));
  TrainingState restored = b.state();
  const LoadedCheckpoint got = load_checkpoint(dir / "a.ckpt", restored);
  EXPECT_TRUE(bitwise_equal(*a.net, *b.net));
  EXPECT_TRUE(same_optimizer_state(kind, *a.opt, *b.opt));
  EXPECT_TRUE(same_sampler(a.sampler.state(), b.sampler.state()));
  EXPECT_EQ(got.meta.step, 9);
  EXPECT_EQ(got.meta.epoch, 1);
  EXPECT_EQ(got.meta.hparams_json, R"({"lr":0.05})");
  EXPECT_EQ(got.meta.world_size, 1);
  EXPECT_EQ(got.meta.keys, (std::vector<std::string>{"model", "optimizer", "sampler", "rng"}));
  EXPECT_EQ(got.meta.format_version, kCheckpointFormatVersion);
  EXPECT_FALSE(got.world_size_changed);
  EXPECT_TRUE(got.per_rank_exact);
  EXPECT_TRUE(got.absent.empty());
  EXPECT_TRUE(got.ignored.empty());

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
  TrainingState saved = a.state();
  save_checkpoint(dir / "zero.ckpt", saved, {});
  TrainRun b(kind, 2, data);
  train(b, 2);
  ASSERT_FALSE(b.opt->state().empty());
  TrainingState restored = b.state();
  load_checkpoint(dir / "zero.ckpt", restored);
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
  TrainingState saved = a.state();
  train(a, n, [&](TrainRun& r) {
    if (r.step == k) ckpt.save(saved, {.step = r.step, .epoch = r.epoch});
  });

  TrainRun b(kind, 2, data);
  torch::manual_seed(12345);  // a fresh process would not share a's generator state
  const ResumePoint resume = ckpt.latest_valid();
  ASSERT_TRUE(resume.path.has_value());
  TrainingState restored = b.state();
  const LoadedCheckpoint got = ckpt.load(*resume.path, restored);
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
  TrainingState saved = a.state();
  train(a, 10, [&](TrainRun& r) {
    if (r.step == 5) save_checkpoint(dir / "k.ckpt", saved, {.step = 5, .epoch = r.epoch});
  });
  for (int leave_out = 0; leave_out < 2; ++leave_out) {
    TrainRun b(OptKind::kSgdMomentum, 2, data);
    torch::manual_seed(12345);
    // Without the generators, or without the optimizer (b.opt keeps empty momentum buffers).
    TrainingState restored = b.state(/*rng=*/leave_out != 0, /*optimizer=*/leave_out != 1);
    const auto got = load_checkpoint(dir / "k.ckpt", restored);
    EXPECT_EQ(got.ignored, (std::vector<std::string>{leave_out == 0 ? "rng" : "optimizer"}));
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

// A model and the generators: what the RNG tests save.
TrainingState model_and_rng(Net& net, bool rng = true) {
  TrainingState s;
  s.add("model", net);
  if (rng) s.add("rng", default_generators());
  return s;
}

TEST(CheckpointRng, StreamContinuesIdenticallyAfterRestore) {
  TempDir dir;
  Net net;
  TrainingState state = model_and_rng(net);
  torch::manual_seed(42);
  torch::randn({1});  // an odd number of scalar normals drawn before the save
  torch::rand({3});
  save_checkpoint(dir / "rng.ckpt", state, {});
  const auto expected = draws();  // the uninterrupted run's next numbers

  torch::manual_seed(999);
  draws();
  load_checkpoint(dir / "rng.ckpt", state);
  const auto got = draws();
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << i;

  // Negative control: without the generators registered they are left alone, and the numbers
  // differ.
  torch::manual_seed(999);
  TrainingState no_rng = model_and_rng(net, /*rng=*/false);
  load_checkpoint(dir / "rng.ckpt", no_rng);
  EXPECT_FALSE(torch::equal(torch::rand({7}), expected[0]));
}

TEST(CheckpointRng, EachRankTakesItsOwnState) {
  // Three ranks with different generator states (per-rank seeds), as a collective save
  // gathers them; the snapshot built by hand since threads share one generator.
  TempDir dir;
  Net net;
  TrainingState state = model_and_rng(net);
  Snapshot snapshot;
  snapshot.world_size = 3;
  snapshot.entries.push_back(state.snapshot().entries.at(0));  // the model
  Snapshot::Entry rng{"rng", StateScope::kPerRank, {}};
  std::vector<at::Tensor> next;
  for (int r = 0; r < 3; ++r) {
    torch::manual_seed(100 + r);
    rng.ranks.push_back(default_generators()->state_dict());
    next.push_back(torch::rand({4}));
  }
  snapshot.entries.push_back(rng);
  testing::write_bytes(dir / "ranks.ckpt", encode_checkpoint(snapshot, {.world_size = 3}));

  for (int r = 0; r < 3; ++r) {
    torch::manual_seed(7);
    const auto got = load_checkpoint(dir / "ranks.ckpt", state, {.rank = r, .world_size = 3});
    EXPECT_TRUE(torch::equal(torch::rand({4}), next[r])) << "rank " << r;
    EXPECT_TRUE(got.per_rank_exact);
    EXPECT_FALSE(got.world_size_changed);
  }
  // At world size 5, rank 4 takes rank 4 % 3 = 1's state, and it is reported as inexact.
  const auto got = load_checkpoint(dir / "ranks.ckpt", state, {.rank = 4, .world_size = 5});
  EXPECT_TRUE(torch::equal(torch::rand({4}), next[1]));
  EXPECT_FALSE(got.per_rank_exact);
  EXPECT_TRUE(got.world_size_changed);
  EXPECT_EQ(got.meta.world_size, 3);
}

// Under ft::Manager a dropped step takes the sampler back to its last committed cursor. A
// checkpoint loaded between steps (ddp-train --ft resuming) is such a point: a step dropped
// right after the resume goes back to the loaded cursor, not to the one before the load (which
// retrained the epoch's start, with the model at the checkpoint's step).
TEST(CheckpointSampler, ALoadedStateIsWhereADroppedStepGoesBack) {
  TempDir dir;
  Net net;
  DistributedSampler saved_sampler(50, {.num_replicas = 1, .rank = 0, .seed = 9});
  saved_sampler.set_epoch(3);
  saved_sampler.advance(17);
  TrainingState saved;
  saved.add("model", net);
  saved.add("sampler", saved_sampler);
  save_checkpoint(dir / "s.ckpt", saved, {.epoch = 3});

  DistributedSampler s(50, {.num_replicas = 1, .rank = 0, .seed = 9});
  TrainingState state;
  state.add("model", net);
  state.add("sampler", s);
  const std::vector<state::GroupBound*> bound = state::group_bound(state);
  ASSERT_EQ(bound.size(), 1u);
  bound[0]->committed();  // a quorum formed at epoch 0, position 0
  load_checkpoint(dir / "s.ckpt", state);
  s.advance(5);                                  // a step's batch taken, then the step dropped
  bound[0]->regroup(testing::one_rank_group());  // the next quorum
  EXPECT_EQ(s.epoch(), 3);
  EXPECT_EQ(s.position(), 17);
  EXPECT_EQ(s.remaining(), saved_sampler.remaining());
}

TEST(CheckpointSampler, StateRoundTripsAndAnotherDatasetIsRefused) {
  TempDir dir;
  Net net;
  DistributedSampler s(50, {.num_replicas = 1, .rank = 0, .seed = 9});
  s.set_epoch(3);
  s.advance(17);
  TrainingState saved;
  saved.add("model", net);
  saved.add("sampler", s);
  save_checkpoint(dir / "s.ckpt", saved, {.epoch = 3});

  DistributedSampler t(50, {.num_replicas = 1, .rank = 0, .seed = 9});
  TrainingState restored;
  restored.add("model", net);
  restored.add("sampler", t);
  load_checkpoint(dir / "s.ckpt", restored);
  EXPECT_TRUE(same_sampler(s.state(), t.state()));
  EXPECT_EQ(t.remaining(), s.remaining());
  EXPECT_EQ(t.position(), 17);

  DistributedSampler other(51, {.num_replicas = 1, .rank = 0, .seed = 9});
  TrainingState mismatched;
  mismatched.add("model", net);
  mismatched.add("sampler", other);
  const auto net_before = testing::snapshot(*net);
  try {
    load_checkpoint(dir / "s.ckpt", mismatched);
    ADD_FAILURE() << "a sampler over another dataset was accepted";
  } catch (const IncompatibleCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("sampler state does not fit"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(other.epoch(), 0);
  EXPECT_EQ(other.position(), 0);
  EXPECT_TRUE(testing::same_as_snapshot(*net, net_before));
}

// --- a user's own state ----------------------------------------------------------------------

// An exponential moving average of a model's weights, as a user would write it: tensors and
// JSON, a check that names what differs, a load in place.
struct Ema : Stateful {
  explicit Ema(torch::nn::Module& m, double d) : decay(d) {
    for (const auto& p : m.named_parameters())
      shadow.emplace_back(p.key(), p.value().detach().clone());
  }
  void update(torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    auto params = m.named_parameters();
    for (auto& [name, t] : shadow) t.mul_(decay).add_(params[name], 1 - decay);
    ++updates;
  }
  StateDict state_dict() override {
    return {.tensors = shadow,
            .json = "{\"decay\": " + std::to_string(decay) +
                    ", \"updates\": " + std::to_string(updates) + "}"};
  }
  std::string check(const StateDict& saved, const LoadContext&) override {
    for (const auto& [name, t] : shadow) {
      const at::Tensor* s = saved.find(name);
      if (!s || !s->sizes().equals(t.sizes()))
        return "no shadow weight '" + name + "' of its shape";
    }
    return "";
  }
  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    for (auto& [name, t] : shadow) t.copy_(*saved.find(name));
    const auto at = saved.json.find("\"updates\":");
    updates = std::stoll(saved.json.substr(at + 10));
  }
  std::vector<std::pair<std::string, at::Tensor>> shadow;
  double decay;
  int64_t updates = 0;
};

TEST(CheckpointUserState, AUsersOwnStatefulRoundTripsAndIsChecked) {
  TempDir dir;
  auto data = testing::make_dataset(44);
  TrainRun a(OptKind::kSgdMomentum, 1, data);
  Ema ema_a(*a.net, 0.9);
  TrainingState saved = a.state();
  saved.add("ema", ema_a);  // one line
  train(a, 7, [&](TrainRun& r) { ema_a.update(*r.net); });
  save_checkpoint(dir / "ema.ckpt", saved, {.step = 7});

  TrainRun b(OptKind::kSgdMomentum, 2, data);
  Ema ema_b(*b.net, 0.9);
  TrainingState restored = b.state();
  restored.add("ema", ema_b);
  const auto got = load_checkpoint(dir / "ema.ckpt", restored);
  EXPECT_EQ(got.meta.keys.back(), "ema");
  EXPECT_EQ(ema_b.updates, 7);
  ASSERT_EQ(ema_b.shadow.size(), ema_a.shadow.size());
  for (size_t i = 0; i < ema_a.shadow.size(); ++i) {
    EXPECT_TRUE(torch::equal(ema_a.shadow[i].second, ema_b.shadow[i].second)) << i;
  }
  // Both go on identically: the EMA follows the same weights.
  b.step = a.step;
  b.epoch = a.epoch;
  auto gen = at::detail::getDefaultCPUGenerator();
  const at::Tensor rng = gen.get_state();
  train(a, 9, [&](TrainRun& r) { ema_a.update(*r.net); });
  gen.set_state(rng);
  train(b, 9, [&](TrainRun& r) { ema_b.update(*r.net); });
  for (size_t i = 0; i < ema_a.shadow.size(); ++i) {
    EXPECT_TRUE(torch::equal(ema_a.shadow[i].second, ema_b.shadow[i].second)) << i;
  }

  // Its check refuses an EMA of another model before anything is restored.
  TrainRun wide(OptKind::kSgdMomentum, 3, data);
  Net other(64);
  Ema ema_other(*other, 0.9);
  TrainingState mismatched = wide.state();
  mismatched.add("ema", ema_other);
  const auto before = testing::snapshot(*wide.net);
  try {
    load_checkpoint(dir / "ema.ckpt", mismatched);
    ADD_FAILURE() << "an EMA of another shape was accepted";
  } catch (const IncompatibleCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("ema: no shadow weight 'fc1.weight' of its shape"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(testing::same_as_snapshot(*wide.net, before));
}

// A user's own kSharded state: rows [begin, end) of a whole [rows, 4] table, the rows split over
// the ranks as evenly as they go (Note [Sharded states]).
struct TableRows : Stateful {
  TableRows(int rank, int world, int64_t rows)
      : rows(rows), begin(rows * rank / world), end(rows * (rank + 1) / world),
        part(torch::zeros({end - begin, 4})) {}
  StateDict state_dict() override {
    return {.tensors = {{"table", part}},
            .shards = {{"table", ShardPlacement{{rows, 4}, begin * 4}}}};
  }
  std::optional<ElementRange> wanted(const std::string& name,
                                     const std::vector<int64_t>& whole) const override {
    if (name != "table" || whole != std::vector<int64_t>{rows, 4}) return std::nullopt;
    return ElementRange{begin * 4, (end - begin) * 4};
  }
  std::string check(const StateDict& saved, const LoadContext&) override {
    const at::Tensor* t = saved.find("table");
    return t && t->defined() && t->numel() == part.numel() ? "" : "no table rows of this shape";
  }
  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    part.copy_(saved.find("table")->view_as(part));
  }
  StateScope scope() const override { return StateScope::kSharded; }
  int64_t rows, begin, end;
  at::Tensor part;
};

// Saved by 3 ranks (10 rows: 3, 3 and 4), through a checkpoint's bytes, loaded at world sizes 1,
// 2 and 4: each rank gets its own rows; a piece missing is named, not filled with zeros.
TEST(CheckpointUserState, AShardedStateLoadsAtAnyWorldSize) {
  const at::Tensor whole = torch::arange(40, torch::kFloat).view({10, 4});
  Snapshot saved;
  saved.world_size = 3;
  saved.entries.push_back({"table", StateScope::kSharded, {}});
  for (int r = 0; r < 3; ++r) {
    TableRows t(r, 3, 10);
    t.part.copy_(whole.narrow(0, t.begin, t.end - t.begin));
    saved.entries[0].ranks.push_back(t.state_dict());
    saved.entries[0].ranks.back().tensors[0].second = t.part.clone();
  }
  const DecodedCheckpoint decoded = decode_checkpoint(encode_checkpoint(saved, {.world_size = 3}));
  for (int world : {1, 2, 4}) {
    for (int r = 0; r < world; ++r) {
      TableRows mine(r, world, 10);
      TrainingState state;
      state.add("table", mine);
      const RestoreReport got = state.restore(decoded.snapshot, r, world);
      EXPECT_TRUE(got.world_size_changed);
      EXPECT_TRUE(torch::equal(mine.part, whole.narrow(0, mine.begin, mine.end - mine.begin)))
          << "rank " << r << " of " << world;
    }
  }
  // Rank 1's piece (rows 3 to 5, elements 12 to 23) lost.
  Snapshot gap = saved;
  gap.entries[0].ranks.erase(gap.entries[0].ranks.begin() + 1);
  TableRows one(0, 1, 10);
  TrainingState state;
  state.add("table", one);
  try {
    state.restore(gap, 0, 1);
    ADD_FAILURE() << "a table with a missing piece was loaded";
  } catch (const IncompatibleStateError& e) {
    EXPECT_NE(std::string(e.what()).find("no saved piece of 'table' holds its elements from 12 "
                                         "(of 40) on"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(torch::equal(one.part, torch::zeros({10, 4})));  // nothing changed
}

TEST(CheckpointUserState, AnOptionalKeyMayBeAbsentARequiredOneMayNot) {
  TempDir dir;
  Net net;
  TrainingState saved;
  saved.add("model", net);
  save_checkpoint(dir / "m.ckpt", saved, {});

  int64_t counter = 5;
  auto counter_state = json_state([&] { return std::to_string(counter); },
                                  [&](const std::string& j) { counter = std::stoll(j); });
  TrainingState optional;
  optional.add("model", net);
  optional.add("counter", counter_state, {.optional = true});
  const auto got = load_checkpoint(dir / "m.ckpt", optional);
  EXPECT_EQ(got.absent, std::vector<std::string>{"counter"});
  EXPECT_EQ(counter, 5);  // left as it was

  TrainingState required;
  required.add("model", net);
  required.add("counter", counter_state);
  try {
    load_checkpoint(dir / "m.ckpt", required);
    ADD_FAILURE() << "a missing required key was accepted";
  } catch (const IncompatibleCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("it holds no 'counter' state"), std::string::npos)
        << e.what();
  }

  // A checkpoint with the counter round-trips it through json_state.
  counter = 11;
  save_checkpoint(dir / "c.ckpt", required, {});
  counter = 0;
  load_checkpoint(dir / "c.ckpt", optional);
  EXPECT_EQ(counter, 11);
}

TEST(CheckpointUserState, BadKeysAndStatesAreConfigErrors) {
  Net net;
  TrainingState s;
  s.add("model", net);
  EXPECT_THROW(s.add("model", net), ConfigError);  // twice
  EXPECT_THROW(s.add("", net), ConfigError);       // empty
  EXPECT_THROW(s.add("a key", net), ConfigError);  // a space
  EXPECT_THROW(s.add("x", std::shared_ptr<Stateful>()), ConfigError);
  // A Stateful whose JSON is not JSON, or whose tensor names repeat.
  TrainingState bad;
  bad.add("bad", json_state([] { return std::string("{not json"); }, [](const std::string&) {}));
  TempDir dir;
  EXPECT_THROW(save_checkpoint(dir / "x.ckpt", bad, {}), ConfigError);
  struct Twice : Stateful {
    StateDict state_dict() override {
      return {.tensors = {{"t", torch::zeros({1})}, {"t", torch::ones({1})}}};
    }
    void load_state_dict(const StateDict&, const LoadContext&) override {}
  } twice;
  TrainingState repeated;
  repeated.add("twice", twice);
  EXPECT_THROW(save_checkpoint(dir / "y.ckpt", repeated, {}), ConfigError);
  EXPECT_FALSE(std::filesystem::exists(dir / "x.ckpt"));
  EXPECT_FALSE(std::filesystem::exists(dir / "y.ckpt"));
}

// --- refusing a checkpoint that does not fit -----------------------------------------------

std::string load_error(const std::filesystem::path& file, TrainingState& state,
                       const LoadOptions& options = {}) {
  try {
    load_checkpoint(file, state, options);
  } catch (const IncompatibleCheckpointError& e) {
    return e.what();
  }
  return "(no IncompatibleCheckpointError)";
}

// A TrainingState of a module and, when given, an optimizer.
TrainingState module_and(torch::nn::Module& m, torch::optim::Optimizer* opt = nullptr) {
  TrainingState s;
  s.add("model", m);
  if (opt) s.add("optimizer", *opt);
  return s;
}

TEST(CheckpointMismatch, AnotherModelIsRefusedNamingTheDifferences) {
  TempDir dir;
  Net small(32);
  torch::optim::SGD opt(small->parameters(), 0.1);
  TrainingState saved = module_and(*small, &opt);
  save_checkpoint(dir / "mlp.ckpt", saved, {.model_label = "--model mlp"});

  Net wide(64);
  torch::optim::SGD wide_opt(wide->parameters(), 0.1);
  const auto before = testing::snapshot(*wide);
  TrainingState wide_state = module_and(*wide, &wide_opt);
  const std::string msg =
      load_error(dir / "mlp.ckpt", wide_state, {.model_label = "--model mlp-wide"});
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
  TrainingState other_state = module_and(*other);
  const std::string msg2 =
      load_error(dir / "mlp.ckpt", other_state, {.model_label = "--model cnn"});
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
  TrainingState dbl_state = module_and(*dbl);
  const std::string msg3 = load_error(dir / "mlp.ckpt", dbl_state);
  EXPECT_NE(msg3.find("checkpoint holds parameter 'fc1.weight' as Float but the model has Double"),
            std::string::npos)
      << msg3;
}

TEST(CheckpointMismatch, AnotherOptimizerIsRefused) {
  TempDir dir;
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  TrainingState with_sgd = module_and(*net, &sgd);
  TrainingState without = module_and(*net);
  save_checkpoint(dir / "sgd.ckpt", with_sgd, {});
  save_checkpoint(dir / "none.ckpt", without, {});

  torch::optim::AdamW adamw(net->parameters());
  TrainingState with_adamw = module_and(*net, &adamw);
  EXPECT_NE(load_error(dir / "sgd.ckpt", with_adamw)
                .find("holds torch::optim::SGD state but this run's optimizer is "
                      "torch::optim::AdamW"),
            std::string::npos);
  EXPECT_NE(load_error(dir / "none.ckpt", with_sgd).find("holds no optimizer state"),
            std::string::npos);
  // Another split into param groups.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto params = net->parameters();
  groups.emplace_back(std::vector<at::Tensor>(params.begin(), params.begin() + 2));
  groups.emplace_back(std::vector<at::Tensor>(params.begin() + 2, params.end()));
  torch::optim::SGD split(groups, torch::optim::SGDOptions(0.1));
  TrainingState with_split = module_and(*net, &split);
  EXPECT_NE(load_error(dir / "sgd.ckpt", with_split)
                .find("param groups of [6] parameters, this run's has [2, 4]"),
            std::string::npos);
}

TEST(CheckpointMeta, WorldSizeChangeIsReported) {
  TempDir dir;
  Net net;
  TrainingState state = model_and_rng(net);
  save_checkpoint(dir / "w4.ckpt", state, {.step = 5, .world_size = 4});
  const CheckpointMeta m = read_checkpoint_meta(dir / "w4.ckpt");
  EXPECT_EQ(m.world_size, 4);
  EXPECT_EQ(m.step, 5);
  EXPECT_EQ(m.keys, (std::vector<std::string>{"model", "rng"}));
  EXPECT_GT(m.num_threads, 0);
  const auto got = load_checkpoint(dir / "w4.ckpt", state);
  EXPECT_TRUE(got.world_size_changed);
  EXPECT_FALSE(got.per_rank_exact);
}

TEST(CheckpointMeta, BadArgumentsAreConfigErrors) {
  TempDir dir;
  Net net;
  TrainingState empty;
  EXPECT_THROW(save_checkpoint(dir / "x.ckpt", empty, {}), ConfigError);
  TrainingState state = module_and(*net);
  EXPECT_THROW(save_checkpoint(dir / "x.ckpt", state, {.hparams_json = "{lr"}), ConfigError);
  EXPECT_FALSE(std::filesystem::exists(dir / "x.ckpt"));
}

// The bytes of a checkpoint in memory are those of its file, and decode back to the snapshot.
TEST(CheckpointBytes, EncodeDecodeRoundTripsAndDamageIsNamed) {
  TempDir dir;
  Net net;
  TrainingState state = model_and_rng(net);
  const std::string bytes = encode_checkpoint(state.snapshot(), {.step = 3, .epoch = 1});
  const DecodedCheckpoint d = decode_checkpoint(bytes, "from rank 1");
  EXPECT_EQ(d.meta.step, 3);
  ASSERT_EQ(d.snapshot.entries.size(), 2u);
  const auto& model = d.snapshot.entries[0].ranks.at(0);
  const auto params = net->named_parameters();
  EXPECT_TRUE(torch::equal(*model.find("fc1.weight"), params["fc1.weight"]));
  // It loads like a file.
  testing::write_bytes(dir / "m.ckpt", bytes);
  EXPECT_NO_THROW(verify_checkpoint(dir / "m.ckpt"));
  // A flipped payload byte is named with the bytes' name.
  std::string damaged = bytes;
  damaged[damaged.size() - 3] ^= 0x40;
  try {
    decode_checkpoint(damaged, "from rank 1");
    ADD_FAILURE() << "damaged bytes were accepted";
  } catch (const CorruptCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("from rank 1: payload checksum mismatch"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace ddp
