// SyncBatchNorm, checked numerically: W thread-ranks over Gloo, each normalising its rows of a
// global batch, must produce what one process's torch::nn::BatchNorm produces on the whole
// batch: outputs, input gradients (each rank's rows), weight/bias gradients (summed over
// ranks: each rank's loss is the sum over its rows, so the sum of the ranks' losses is the
// one-process loss), running statistics and num_batches_tracked. Batches may differ in size
// between ranks, empty ones included. Eval mode must be BatchNorm's, with no collective.
// Then: errors raised on every rank, the Sequential converter, state-dict interchange, and
// DistributedDataParallel + SyncBatchNorm = one process with BatchNorm on the N*b batch.
#include <functional>
#include <latch>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/distributed_data_parallel.h"
#include "ddp/error.h"
#include "ddp/sync_batch_norm.h"
#include "support/models.h"
#include "support/ranks.h"

namespace ddp {
namespace {

using namespace ddp::testing;

// Runs fn(group) on `world` thread-ranks; any exception fails the test.
void run_group(int world, const std::function<void(const std::shared_ptr<ProcessGroup>&)>& fn) {
  const int port = free_port();
  auto errors = run_threads(world, [&](int r) {
    auto pg = make_process_group(thread_rank(r, world, port, std::chrono::seconds(60)));
    fn(pg);
    pg->barrier().wait();
  });
  for (int r = 0; r < world; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << message_of(errors[r]);
  }
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.numel() == 0) return 0;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// One-process reference: BatchNorm1d/2d/3d by the input's rank.
torch::nn::AnyModule make_reference(int64_t input_dim, const SyncBatchNormOptions& o) {
  auto bo = torch::nn::BatchNormOptions(o.num_features)
                .eps(o.eps)
                .affine(o.affine)
                .track_running_stats(o.track_running_stats);
  bo.momentum(o.momentum ? c10::optional<double>(*o.momentum) : c10::nullopt);
  if (input_dim <= 3) return torch::nn::AnyModule(torch::nn::BatchNorm1d(bo));
  if (input_dim == 4) return torch::nn::AnyModule(torch::nn::BatchNorm2d(bo));
  return torch::nn::AnyModule(torch::nn::BatchNorm3d(bo));
}

void set_parameters(torch::nn::Module& m, const at::Tensor& w, const at::Tensor& b) {
  torch::NoGradGuard g;
  auto p = m.named_parameters();
  if (auto* weight = p.find("weight")) weight->copy_(w);
  if (auto* bias = p.find("bias")) bias->copy_(b);
}

// Module::to(dtype) would also turn num_batches_tracked (int64) into a floating point tensor.
void to_dtype(torch::nn::Module& m, at::ScalarType dtype) {
  for (auto& p : m.parameters()) p.set_data(p.detach().to(dtype));
  for (auto& b : m.buffers()) {
    if (b.is_floating_point()) b.set_data(b.to(dtype));
  }
}

struct BnCase {
  std::vector<int64_t> sample;  // one row's shape: {C, *}
  std::vector<int64_t> rows;    // rows per rank; its size is the world size
  at::ScalarType dtype = at::kFloat;
  SyncBatchNormOptions options;  // num_features is sample[0]
  int steps = 3;
  double tolerance = 1e-5;
};

struct StepOut {
  at::Tensor y, dx, dweight, dbias;
};
struct RankOut {
  std::vector<StepOut> steps;
  std::map<std::string, at::Tensor> buffers;
  at::Tensor eval_y;  // this rank's rows of the eval batch, in eval mode
};

struct Data {
  std::vector<at::Tensor> x, g;  // per step: the global batch [sum(rows), C, *], loss weights
  at::Tensor x_eval;             // [sum(rows), C, *]
  at::Tensor w0, b0;             // initial weight and bias [C]
};

Data make_data(const BnCase& c) {
  torch::manual_seed(2024);
  int64_t total = 0;
  for (int64_t r : c.rows) total += r;
  std::vector<int64_t> shape{total};
  shape.insert(shape.end(), c.sample.begin(), c.sample.end());
  const int64_t channels = c.sample[0];
  std::vector<int64_t> per_channel(shape.size(), 1);
  per_channel[1] = channels;
  // Channel k has mean ~k and standard deviation ~(1 + k/2): the mean subtraction matters.
  auto offset = torch::arange(channels, at::kDouble).view(per_channel).to(c.dtype);
  auto make_x = [&] { return torch::randn(shape, c.dtype) * (1 + offset / 2) + offset; };
  Data d;
  for (int s = 0; s < c.steps; ++s) {
    d.x.push_back(make_x());
    d.g.push_back(torch::randn(shape, c.dtype));
  }
  d.x_eval = make_x();
  d.w0 = (1 + 0.3 * torch::randn({channels}, at::kDouble)).to(c.dtype);
  d.b0 = (0.3 * torch::randn({channels}, at::kDouble)).to(c.dtype);
  return d;
}

int64_t offset_of(const BnCase& c, int r) {
  int64_t off = 0;
  for (int k = 0; k < r; ++k) off += c.rows[k];
  return off;
}

// The reference on the whole batch; returns its results shaped like one rank's.
RankOut run_reference(const BnCase& c, const Data& d, std::vector<at::Tensor>* eval_slices) {
  SyncBatchNormOptions o = c.options;
  o.num_features = c.sample[0];
  auto ref = make_reference(static_cast<int64_t>(c.sample.size()) + 1, o);
  auto m = ref.ptr();
  to_dtype(*m, c.dtype);
  set_parameters(*m, d.w0, d.b0);
  RankOut out;
  for (int s = 0; s < c.steps; ++s) {
    m->zero_grad();
    auto x = d.x[s].clone().requires_grad_(true);
    auto y = ref.forward(x);
    (y * d.g[s]).sum().backward();
    StepOut so{y.detach(), x.grad()};
    if (o.affine) {
      so.dweight = m->named_parameters()["weight"].grad().clone();
      so.dbias = m->named_parameters()["bias"].grad().clone();
    }
    out.steps.push_back(so);
  }
  for (const auto& b : m->named_buffers()) out.buffers[b.key()] = b.value().clone();
  m->eval();
  torch::NoGradGuard g;
  if (o.track_running_stats) {
    out.eval_y = ref.forward(d.x_eval);
  } else {
    // No running statistics: each rank normalises its own rows with their statistics.
    for (size_t r = 0; r < c.rows.size(); ++r) {
      auto slice = d.x_eval.narrow(0, offset_of(c, static_cast<int>(r)), c.rows[r]);
      eval_slices->push_back(slice.numel() / o.num_features > 1 ? ref.forward(slice)
                                                                : at::Tensor());
    }
  }
  return out;
}

void check_case(const BnCase& c) {
  const int world = static_cast<int>(c.rows.size());
  const Data d = make_data(c);
  std::vector<at::Tensor> ref_eval_slices;
  const RankOut ref = run_reference(c, d, &ref_eval_slices);
  std::vector<RankOut> outs(world);
  run_group(world, [&](const std::shared_ptr<ProcessGroup>& pg) {
    const int r = pg->rank();
    SyncBatchNormOptions o = c.options;
    o.num_features = c.sample[0];
    o.process_group = pg;
    SyncBatchNorm bn(o);
    to_dtype(*bn, c.dtype);
    set_parameters(*bn, d.w0, d.b0);
    const int64_t off = offset_of(c, r), n = c.rows[r];
    RankOut& out = outs[r];
    for (int s = 0; s < c.steps; ++s) {
      bn->zero_grad();
      auto x = d.x[s].narrow(0, off, n).clone().requires_grad_(true);
      const uint64_t before = pg->last_sequence_number();
      auto y = bn(x);
      (y * d.g[s].narrow(0, off, n)).sum().backward();
      // A collective in forward and one in backward (none at world size 1).
      EXPECT_EQ(pg->last_sequence_number() - before, world > 1 ? 2u : 0u) << "rank " << r;
      StepOut so{y.detach(), x.grad()};
      if (o.affine) {
        so.dweight = bn->weight.grad().clone();
        so.dbias = bn->bias.grad().clone();
      }
      out.steps.push_back(so);
    }
    for (const auto& b : bn->named_buffers()) out.buffers[b.key()] = b.value().clone();
    bn->eval();
    const uint64_t before = pg->last_sequence_number();
    torch::NoGradGuard g;
    auto slice = d.x_eval.narrow(0, off, n);
    if (o.track_running_stats || slice.numel() / o.num_features > 1) out.eval_y = bn(slice);
    EXPECT_EQ(pg->last_sequence_number(), before) << "rank " << r << ": eval communicated";
  });

  const double tol = c.tolerance;
  for (int s = 0; s < c.steps; ++s) {
    at::Tensor dweight, dbias;
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(outs[r].steps.size(), static_cast<size_t>(c.steps)) << "rank " << r;
      const auto& got = outs[r].steps[s];
      const auto& want = ref.steps[s];
      const int64_t off = offset_of(c, r), n = c.rows[r];
      EXPECT_LE(max_diff(got.y, want.y.narrow(0, off, n)), tol) << "y, step " << s << " rank " << r;
      EXPECT_LE(max_diff(got.dx, want.dx.narrow(0, off, n)), tol)
          << "dx, step " << s << " rank " << r;
      if (c.options.affine) {
        dweight = dweight.defined() ? dweight + got.dweight : got.dweight;
        dbias = dbias.defined() ? dbias + got.dbias : got.dbias;
      }
    }
    if (c.options.affine) {
      EXPECT_LE(max_diff(dweight, ref.steps[s].dweight), tol) << "sum of dweight, step " << s;
      EXPECT_LE(max_diff(dbias, ref.steps[s].dbias), tol) << "sum of dbias, step " << s;
    }
  }
  for (int r = 0; r < world; ++r) {
    for (const auto& [name, want] : ref.buffers) {
      ASSERT_TRUE(outs[r].buffers.count(name)) << name;
      const auto& got = outs[r].buffers.at(name);
      ASSERT_EQ(got.defined(), want.defined()) << name;
      if (!want.defined()) continue;
      if (name == "num_batches_tracked") {
        EXPECT_EQ(got.item<int64_t>(), want.item<int64_t>()) << "rank " << r;
      } else {
        EXPECT_LE(max_diff(got, want), tol) << name << ", rank " << r;
      }
    }
    const int64_t off = offset_of(c, r), n = c.rows[r];
    if (c.options.track_running_stats) {
      EXPECT_LE(max_diff(outs[r].eval_y, ref.eval_y.narrow(0, off, n)), tol) << "eval, rank " << r;
    } else if (ref_eval_slices[r].defined()) {
      EXPECT_LE(max_diff(outs[r].eval_y, ref_eval_slices[r]), tol) << "eval, rank " << r;
    }
  }
}

std::vector<int64_t> even_rows(int world, int64_t b = 4) { return std::vector<int64_t>(world, b); }

// Different sizes per rank, an empty rank from world size 3 on.
std::vector<int64_t> uneven_rows(int world) {
  switch (world) {
    case 1: return {5};
    case 2: return {1, 6};
    case 3: return {2, 0, 5};
    default: return {3, 0, 1, 4};
  }
}

class SyncBn : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_P(SyncBn, TwoDFloatEvenBatches) {
  check_case({.sample = {3, 5, 4}, .rows = even_rows(GetParam()), .dtype = at::kFloat});
}

TEST_P(SyncBn, TwoDDoubleUnevenBatchesWithAnEmptyRank) {
  check_case({.sample = {3, 5, 4},
              .rows = uneven_rows(GetParam()),
              .dtype = at::kDouble,
              .tolerance = 1e-10});
}

TEST_P(SyncBn, TwoDFloatUnevenBatches) {
  check_case({.sample = {4, 3, 3}, .rows = uneven_rows(GetParam()), .dtype = at::kFloat});
}

TEST_P(SyncBn, OneDFloatRowsOnly) {  // [N, C]: one value per channel per row
  check_case({.sample = {6}, .rows = even_rows(GetParam(), 3), .dtype = at::kFloat});
}

TEST_P(SyncBn, OneDDoubleWithLengthUneven) {  // [N, C, L]
  check_case({.sample = {3, 7},
              .rows = uneven_rows(GetParam()),
              .dtype = at::kDouble,
              .tolerance = 1e-10});
}

TEST_P(SyncBn, ThreeDDouble) {
  check_case({.sample = {2, 3, 2, 4},
              .rows = even_rows(GetParam(), 2),
              .dtype = at::kDouble,
              .tolerance = 1e-10});
}

TEST_P(SyncBn, NoAffineCumulativeMomentum) {
  check_case({.sample = {3, 4, 4},
              .rows = uneven_rows(GetParam()),
              .dtype = at::kDouble,
              .options = {.momentum = std::nullopt, .affine = false},
              .steps = 4,
              .tolerance = 1e-10});
}

TEST_P(SyncBn, NoRunningStatsEvalUsesEachRanksBatch) {
  check_case({.sample = {3, 4, 4},
              .rows = even_rows(GetParam(), 3),
              .dtype = at::kDouble,
              .options = {.momentum = 0.3, .track_running_stats = false},
              .tolerance = 1e-10});
}

// A rank whose input has the wrong channel count takes part in the collective anyway, so every
// rank raises a clear error (no rank is left waiting) and the group stays usable.
TEST_P(SyncBn, ChannelMismatchOnOneRankFailsEveryRank) {
  const int world = GetParam();
  const int bad = world - 1;
  run_group(world, [&](const std::shared_ptr<ProcessGroup>& pg) {
    SyncBatchNorm bn({.num_features = 3, .process_group = pg});
    const int r = pg->rank();
    auto x = torch::randn({4, r == bad ? 5 : 3, 2, 2});
    try {
      bn(x);
      ADD_FAILURE() << "rank " << r << ": no error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("SyncBatchNorm(3)"), std::string::npos) << msg;
      if (r == bad) {
        EXPECT_NE(msg.find("expected 3 channels"), std::string::npos) << msg;
        EXPECT_NE(msg.find("[4, 5, 2, 2]"), std::string::npos) << msg;
      } else {
        EXPECT_NE(msg.find(fmt::format("rank {} (5 channels)", bad)), std::string::npos) << msg;
      }
    }
    EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 0) << "a failed forward counted";
    auto y = bn(torch::randn({4, 3, 2, 2}));  // still in step with the others
    y.sum().backward();
  });
}

TEST_P(SyncBn, FewerThanTwoValuesPerChannelOverAllRanks) {
  const int world = GetParam();
  run_group(world, [&](const std::shared_ptr<ProcessGroup>& pg) {
    SyncBatchNorm bn({.num_features = 3, .process_group = pg});
    const int r = pg->rank();
    // One row in all, on rank 0: an error everywhere.
    try {
      bn(torch::randn({r == 0 ? 1 : 0, 3}));
      ADD_FAILURE() << "rank " << r << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("expected more than 1 value per channel"),
                std::string::npos)
          << e.what();
    }
    // One row on each of two ranks is enough (not at world size 1).
    if (world > 1) bn(torch::randn({r < 2 ? 1 : 0, 3}));
    // Eval mode uses running statistics: one row is fine.
    bn->eval();
    bn(torch::randn({1, 3}));
  });
}

// A rank that skips a train-mode forward leaves the others waiting until the group's timeout;
// the error says which module and what the contract is.
TEST(SyncBatchNormModule, SkippedForwardTimesOutNamingTheModule) {
  const int port = free_port();
  std::latch rank0_done(1);
  std::string message;
  auto errors = run_threads(2, [&](int r) {
    auto pg = make_process_group(thread_rank(r, 2, port, std::chrono::seconds(1)));
    if (r == 0) {
      SyncBatchNorm bn({.num_features = 3, .process_group = pg});
      try {
        bn(torch::randn({4, 3}));
      } catch (const TimeoutError& e) {
        message = e.what();
      }
      rank0_done.count_down();
    } else {
      rank0_done.wait();  // rank 1 never runs its forward
    }
  });
  EXPECT_FALSE(errors[0]) << message_of(errors[0]);
  EXPECT_FALSE(errors[1]) << message_of(errors[1]);
  for (const char* needle : {"all_gather #1", "SyncBatchNorm(3) forward", "every rank must run"}) {
    EXPECT_NE(message.find(needle), std::string::npos) << needle << " not in: " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, SyncBn, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(SyncBatchNormModule, InvalidInputAtWorldSizeOne) {
  SyncBatchNorm bn(3);
  EXPECT_THROW(bn(torch::randn({4, 2, 5})), Error);
  EXPECT_THROW(bn(torch::randn({3})), Error);
  EXPECT_THROW(bn(torch::randn({1, 3})), Error);
  EXPECT_THROW(bn(at::Tensor()), Error);
  EXPECT_THROW(SyncBatchNorm(0), ConfigError);
}

// No group given and no default group: plain BatchNorm (world size 1), in train mode too.
TEST(SyncBatchNormModule, WithoutAnyGroupIsBatchNorm) {
  torch::manual_seed(3);
  SyncBatchNorm sync(4);
  torch::nn::BatchNorm2d bn(4);
  EXPECT_EQ(sync->group(), nullptr);
  for (int s = 0; s < 3; ++s) {
    auto x = torch::randn({5, 4, 3, 3}) * 2 + 1;
    auto xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
    auto ya = sync(xa), yb = bn(xb);
    EXPECT_TRUE(torch::equal(ya, yb));
    (ya * ya).sum().backward();
    (yb * yb).sum().backward();
    EXPECT_TRUE(torch::equal(xa.grad(), xb.grad()));
  }
  EXPECT_TRUE(torch::equal(sync->weight.grad(), bn->weight.grad()));
  EXPECT_TRUE(torch::equal(sync->running_var, bn->running_var));
  EXPECT_EQ(sync->num_batches_tracked.item<int64_t>(), 3);
}

// Same names, shapes and initial values as BatchNorm: checkpoints load both ways.
TEST(SyncBatchNormModule, StateDictInterchangeableWithBatchNorm) {
  torch::nn::BatchNorm2d bn(5);
  SyncBatchNorm sync(5);
  auto names = [](torch::nn::Module& m) {
    std::vector<std::string> n;
    for (const auto& p : m.named_parameters()) n.push_back("p:" + p.key());
    for (const auto& b : m.named_buffers()) n.push_back("b:" + b.key());
    return n;
  };
  EXPECT_EQ(names(*bn), names(*sync));
  for (const auto& p : bn->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), sync->named_parameters()[p.key()])) << p.key();
  }
  for (const auto& b : bn->named_buffers()) {
    EXPECT_TRUE(torch::equal(b.value(), sync->named_buffers()[b.key()])) << b.key();
  }
  // BatchNorm checkpoint -> SyncBatchNorm.
  bn->train();
  bn(torch::randn({6, 5, 2, 2}));
  {
    torch::NoGradGuard g;
    bn->weight.uniform_();
    bn->bias.uniform_();
  }
  std::stringstream stream;
  torch::save(bn, stream);
  torch::load(sync, stream);
  for (const auto& p : bn->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), sync->named_parameters()[p.key()])) << p.key();
  }
  for (const auto& b : bn->named_buffers()) {
    EXPECT_TRUE(torch::equal(b.value(), sync->named_buffers()[b.key()])) << b.key();
  }
  // And back.
  sync(torch::randn({6, 5, 2, 2}));
  std::stringstream back;
  torch::save(sync, back);
  torch::nn::BatchNorm2d bn2(5);
  torch::load(bn2, back);
  EXPECT_TRUE(torch::equal(bn2->running_mean, sync->running_mean));
  EXPECT_EQ(bn2->num_batches_tracked.item<int64_t>(), 2);
}

TEST(SyncBatchNormModule, CloneCopiesStateAndOptions) {
  SyncBatchNorm a({.num_features = 3, .eps = 1e-3, .momentum = std::nullopt});
  a(torch::randn({4, 3}));
  auto b = std::dynamic_pointer_cast<SyncBatchNormImpl>(a->clone());
  ASSERT_TRUE(b);
  EXPECT_EQ(b->options.eps, 1e-3);
  EXPECT_FALSE(b->options.momentum.has_value());
  EXPECT_TRUE(torch::equal(a->running_mean, b->running_mean));
  EXPECT_NE(a->running_mean.data_ptr(), b->running_mean.data_ptr());
  std::ostringstream s;
  s << *b;
  EXPECT_EQ(s.str(),
            "ddp::SyncBatchNorm(3, eps=0.001, momentum=None, affine=true, "
            "track_running_stats=true)");
}

// The header's pattern for user modules: choose the layer by a flag, same state-dict names.
struct FlagBlockImpl : torch::nn::Module {
  FlagBlockImpl(int64_t c, bool sync) {
    bn = sync ? torch::nn::AnyModule(SyncBatchNorm(c))
              : torch::nn::AnyModule(torch::nn::BatchNorm2d(c));
    register_module("bn", bn.ptr());
  }
  at::Tensor forward(const at::Tensor& x) { return bn.forward(x); }
  torch::nn::AnyModule bn;
};
TORCH_MODULE(FlagBlock);

TEST(SyncBatchNormModule, ChooseByFlagPattern) {
  FlagBlock plain(4, false), sync(4, true);
  EXPECT_TRUE(std::dynamic_pointer_cast<SyncBatchNormImpl>(sync->bn.ptr()));
  std::vector<std::string> a, b;
  for (const auto& p : plain->named_parameters()) a.push_back(p.key());
  for (const auto& p : sync->named_parameters()) b.push_back(p.key());
  EXPECT_EQ(a, b);
  auto x = torch::randn({3, 4, 2, 2});
  EXPECT_TRUE(torch::equal(plain(x), sync(x)));  // world size 1: the same computation
}

// --- the converter

// A user module holding a BatchNorm as a member: the converter cannot rewire it.
struct HiddenBnImpl : torch::nn::Module {
  HiddenBnImpl() { bn = register_module("bn", torch::nn::BatchNorm1d(10)); }
  at::Tensor forward(const at::Tensor& x) { return bn(x); }
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(HiddenBn);

template <typename BN>
void scramble(BN& bn, int64_t batches) {
  torch::NoGradGuard g;
  if (bn->weight.defined()) {
    bn->weight.uniform_(0.5, 1.5);
    bn->bias.uniform_(-0.5, 0.5);
  }
  bn->running_mean.uniform_(-1, 1);
  bn->running_var.uniform_(0.5, 2);
  bn->num_batches_tracked.fill_(batches);
}

void expect_converted(const std::shared_ptr<torch::nn::Module>& before,
                      const std::shared_ptr<torch::nn::Module>& after,
                      const torch::nn::BatchNormOptions& o, const std::string& what) {
  auto sync = std::dynamic_pointer_cast<SyncBatchNormImpl>(after);
  ASSERT_TRUE(sync) << what << " was not converted";
  EXPECT_EQ(sync->options.num_features, o.num_features()) << what;
  EXPECT_EQ(sync->options.eps, o.eps()) << what;
  EXPECT_EQ(sync->options.momentum.has_value(), o.momentum().has_value()) << what;
  if (o.momentum()) EXPECT_EQ(*sync->options.momentum, *o.momentum()) << what;
  EXPECT_EQ(sync->options.affine, o.affine()) << what;
  EXPECT_EQ(sync->is_training(), before->is_training()) << what;
  auto bp = before->named_parameters();
  for (const auto& p : after->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), bp[p.key()])) << what << "." << p.key();
    EXPECT_NE(p.value().data_ptr(), bp[p.key()].data_ptr()) << what << ": copied, not shared";
    EXPECT_EQ(p.value().requires_grad(), bp[p.key()].requires_grad()) << what << "." << p.key();
  }
  auto bb = before->named_buffers();
  for (const auto& b : after->named_buffers()) {
    EXPECT_TRUE(torch::equal(b.value(), bb[b.key()])) << what << "." << b.key();
    EXPECT_EQ(b.value().scalar_type(), bb[b.key()].scalar_type()) << what << "." << b.key();
  }
}

// A nested block as LibTorch allows it: a Sequential subclass with a forward() of its own.
struct BlockImpl : torch::nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  at::Tensor forward(const at::Tensor& x) { return SequentialImpl::forward(x); }
};
TORCH_MODULE(Block);

TEST(ConvertSyncBatchNorm, ReplacesBatchNormsAndKeepsOtherModules) {
  torch::manual_seed(11);
  auto conv1 = torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3));
  auto bn1 = torch::nn::BatchNorm2d(4);
  auto block = Block(torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 6, 3)), torch::nn::ReLU());
  auto fc = torch::nn::Linear(6 * 4 * 4, 10);
  auto bn2 = torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(10).affine(false).momentum(0.2));
  scramble(bn1, 7);
  scramble(bn2, 5);
  bn1->weight.requires_grad_(false);  // frozen
  torch::nn::Sequential seq;
  seq->push_back("conv", conv1);
  seq->push_back("bn", bn1);
  seq->push_back("relu", torch::nn::ReLU());
  seq->push_back("block", block);
  seq->push_back("flatten", torch::nn::Flatten());
  seq->push_back("fc", fc);
  seq->push_back("bn_out", bn2);

  auto conv = convert_sync_batchnorm(seq);
  ASSERT_EQ(conv->size(), seq->size());
  const auto before = seq->named_children(), after = conv->named_children();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_EQ(before[i].key(), after[i].key());
  for (size_t i : {0, 2, 3, 4, 5}) EXPECT_EQ(conv->ptr(i).get(), seq->ptr(i).get()) << i;
  EXPECT_EQ(conv->ptr(3).get(), block.ptr().get());
  expect_converted(bn1.ptr(), conv->ptr(1), bn1->options, "bn");
  expect_converted(bn2.ptr(), conv->ptr(6), bn2->options, "bn_out");
  // The original is untouched.
  EXPECT_EQ(seq->ptr(1).get(), bn1.ptr().get());
  EXPECT_EQ(seq->ptr(6).get(), bn2.ptr().get());
  // Same parameter and buffer names: checkpoints of either load into the other.
  auto keys = [](const auto& dict) {
    std::vector<std::string> k;
    for (const auto& item : dict) k.push_back(item.key());
    return k;
  };
  EXPECT_EQ(keys(seq->named_parameters()), keys(conv->named_parameters()));
  EXPECT_EQ(keys(seq->named_buffers()), keys(conv->named_buffers()));

  // World size 1 (no group): the converted model computes what the original does, in train
  // mode (running statistics included) and in eval mode.
  auto x = torch::randn({5, 1, 8, 8});
  EXPECT_LE(max_diff(seq->forward(x), conv->forward(x)), 1e-6);
  auto ba = seq->named_buffers(), bb = conv->named_buffers();
  for (const auto& b : ba) EXPECT_LE(max_diff(b.value(), bb[b.key()]), 1e-6) << b.key();
  seq->eval();
  conv->eval();
  EXPECT_LE(max_diff(seq->forward(x), conv->forward(x)), 1e-6);
}

TEST(ConvertSyncBatchNorm, CopiesOptionsModeAndDtypeOf3d) {
  auto bn = torch::nn::BatchNorm3d(torch::nn::BatchNormOptions(3).eps(1e-3).momentum(c10::nullopt));
  bn->to(at::kDouble);  // (LibTorch's Module::to also makes num_batches_tracked a double)
  scramble(bn, 4);
  bn->eval();
  torch::nn::Sequential seq(bn);
  auto conv = convert_sync_batchnorm(seq);
  expect_converted(bn.ptr(), conv->ptr(0), bn->options, "0");
  auto x = torch::randn({2, 3, 2, 2, 2}, at::kDouble);
  EXPECT_TRUE(torch::equal(seq->forward(x), conv->forward(x)));
}

TEST(ConvertSyncBatchNorm, RefusesBatchNormsItCannotRewire) {
  auto message = [](const torch::nn::Sequential& seq) -> std::string {
    try {
      convert_sync_batchnorm(seq);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  // Inside a user module.
  std::string msg = message(torch::nn::Sequential(torch::nn::Linear(4, 10), HiddenBn()));
  EXPECT_NE(msg.find("1.bn is a torch::nn::BatchNorm1dImpl"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Construct ddp::SyncBatchNorm there"), std::string::npos) << msg;
  // Inside a nested block (a Sequential subclass: its forward() is user code).
  msg = message(torch::nn::Sequential(torch::nn::Linear(4, 10), Block(torch::nn::Linear(10, 10),
                                                                      torch::nn::BatchNorm1d(10))));
  EXPECT_NE(msg.find("1.1 is a torch::nn::BatchNorm1dImpl"), std::string::npos) << msg;
  // A Sequential subclass at the top.
  msg = message(torch::nn::Sequential(
      std::shared_ptr<torch::nn::SequentialImpl>(Block(torch::nn::BatchNorm1d(10)).ptr())));
  EXPECT_NE(msg.find("subclass"), std::string::npos) << msg;
}

TEST(ConvertSyncBatchNorm, PassesTheGroupOn) {
  run_group(2, [](const std::shared_ptr<ProcessGroup>& pg) {
    torch::nn::Sequential seq(torch::nn::BatchNorm1d(3), torch::nn::BatchNorm1d(3));
    auto conv = convert_sync_batchnorm(seq, pg);
    for (size_t i = 0; i < 2; ++i) {
      auto sync = std::dynamic_pointer_cast<SyncBatchNormImpl>(conv->ptr(i));
      ASSERT_TRUE(sync);
      EXPECT_EQ(sync->options.process_group, pg);
    }
    const uint64_t before = pg->last_sequence_number();
    conv->forward(torch::randn({2, 3}));
    EXPECT_EQ(pg->last_sequence_number() - before, 2u);  // one all_gather per layer
  });
}

// --- DistributedDataParallel + SyncBatchNorm: N ranks x b = one process x N*b, for a BN model.

// support/models.h's Cnn with SyncBatchNorm: same parameter and buffer names.
struct SyncCnnImpl : torch::nn::Module {
  explicit SyncCnnImpl(const std::shared_ptr<ProcessGroup>& pg) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    bn1 = register_module("bn1", SyncBatchNorm({.num_features = 4, .process_group = pg}));
    conv2 =
        register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 3).stride(2)));
    bn2 = register_module("bn2", SyncBatchNorm({.num_features = 8, .process_group = pg}));
    fc = register_module("fc", torch::nn::Linear(8 * 4 * 4, 10));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = torch::relu(bn2(conv2(h)));
    return fc(h.flatten(1));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  SyncBatchNorm bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc{nullptr};
};

TEST_P(SyncBn, DdpCnnEqualsOneProcessBatchNormOnTheWholeBatch) {
  const int n = GetParam();
  constexpr int kSteps = 10;
  constexpr int64_t kPerRank = 4;
  torch::manual_seed(1234);
  std::vector<at::Tensor> xs, ys;
  for (int s = 0; s < kSteps; ++s) {
    xs.push_back(torch::randn({n * kPerRank, 1, 12, 12}));
    ys.push_back(torch::randint(0, 10, {n * kPerRank}));
  }
  torch::manual_seed(7);
  Cnn reference;
  Cnn init;
  copy_state(*reference, *init);
  auto sgd = [](torch::nn::Module& m) {
    return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  };
  {
    auto opt = sgd(*reference);
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      torch::cross_entropy_loss(reference(xs[s]), ys[s]).backward();
      opt.step();
    }
  }
  std::vector<std::shared_ptr<SyncCnnImpl>> replicas(n);
  run_group(n, [&](const std::shared_ptr<ProcessGroup>& pg) {
    const int r = pg->rank();
    auto replica = std::make_shared<SyncCnnImpl>(pg);
    if (r == 0) copy_state(*init, *replica);  // the others start random: DDP broadcasts
    DistributedDataParallel model(replica, {.process_group = pg});
    auto opt = sgd(*replica);
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      torch::cross_entropy_loss(model(xs[s].chunk(n)[r]), ys[s].chunk(n)[r]).backward();
      opt.step();
    }
    replicas[r] = replica;
  });
  auto ref_buffers = reference->named_buffers();
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(replicas[r]) << "rank " << r << " did not finish";
    EXPECT_LE(max_param_diff(*replicas[r], *reference), 1e-5) << "rank " << r;
    for (const auto& b : replicas[r]->named_buffers()) {
      EXPECT_LE(max_diff(b.value(), ref_buffers[b.key()]), 1e-5) << b.key() << ", rank " << r;
    }
  }
}

}  // namespace
}  // namespace ddp
