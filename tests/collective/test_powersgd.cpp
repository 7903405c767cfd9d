// The PowerSGD comm hook (Note [PowerSGD]) with ranks as threads: the averaged gradients equal
// those of python3-torch's own powerSGD_hook on the same gradients (same seed, same buckets),
// step after step, through the switch from plain all-reduce to compression, warm start and
// error feedback; a checkpoint resumes it bitwise; bad options and mismatched state are
// refused with messages that say what to do. Also the chained Future it is built on.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "ddp/checkpoint.h"
#include "ddp/comm_hooks.h"
#include "ddp/distributed_data_parallel.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using ddp::DistributedDataParallel;
using ddp::ProcessGroup;
using ddp::comm_hooks::PowerSGDOptions;
using ddp::comm_hooks::PowerSGDState;

constexpr const char* kPython = "/usr/bin/python3";
constexpr int kWorld = 2;

struct TempDir {  // removed with everything in it
  explicit TempDir(const std::string& prefix) : path_(ddp::testing::make_temp_dir(prefix)) {}
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Parameters of the given shapes; the loss sum_i (p_i * g_i).sum() gives p_i the gradient g_i,
// built in the same order as powersgd_reference.py's so that autograd fires them alike.
struct ParamsImpl : torch::nn::Module {
  explicit ParamsImpl(const std::vector<std::vector<int64_t>>& shapes) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      params.push_back(register_parameter(fmt::format("p{}", i), torch::zeros(shapes[i])));
    }
  }
  at::Tensor forward(const std::vector<at::Tensor>& grads) {
    at::Tensor loss;
    for (size_t i = 0; i < grads.size(); ++i) {
      at::Tensor term = (params[i] * grads[i]).sum();
      loss = loss.defined() ? loss + term : term;
    }
    return loss;
  }
  std::vector<at::Tensor> params;
};
TORCH_MODULE(Params);

struct Case {
  std::string name;
  std::vector<std::vector<int64_t>> shapes;
  int steps = 6;
  PowerSGDOptions options;
  int64_t bucket_bytes = 25 << 20;
  int64_t first_bucket_bytes = 1 << 20;
  bool bucket_views = false;  // ours with gradient_as_bucket_view (PyTorch's run: without)
};

// A linear layer, its bias, a conv kernel (16 x 36 as a matrix), a second matrix of the first
// shape (grouped with it), a classifier, and matrices too small or thin to compress.
const std::vector<std::vector<int64_t>> kShapes = {{64, 32}, {64}, {16, 4, 3, 3}, {16},
                                                   {64, 32}, {10, 64}, {10}, {5, 3}, {1, 40}};

std::vector<Case> cases() {
  std::vector<Case> out;
  Case a{.name = "rank1_defaults_one_bucket", .shapes = kShapes};
  a.options.start_powerSGD_iter = 2;
  out.push_back(a);
  // Rank 4 takes the QR path; batched shapes; several buckets (rebuilt after iteration 1). The
  // first bucket's limit equals the others': PyTorch 2.x takes an explicit bucket_cap_mb as the
  // first bucket's limit too (1.13 keeps _DEFAULT_FIRST_BUCKET_BYTES), so only then do both
  // versions bucket alike.
  Case b{.name = "rank4_qr_batched_buckets", .shapes = kShapes, .steps = 7,
         .bucket_bytes = 10 << 10, .first_bucket_bytes = 10 << 10};
  b.options.matrix_approximation_rank = 4;
  b.options.start_powerSGD_iter = 3;
  b.options.orthogonalization_epsilon = 1e-8;
  b.options.random_seed = 7;
  b.options.batch_tensors_with_same_shape = true;
  b.options.min_compression_rate = 1.5;
  out.push_back(b);
  // No state kept: a fresh Q at every iteration. (Not from iteration 0: there PyTorch's DDP
  // reduces everything as one bucket and ours already in buckets of reverse registration
  // order, so a hook that compresses in iteration 0 sees other buckets; from the rebuild on,
  // both bucket in the observed order.)
  Case c{.name = "rank2_no_error_feedback_no_warm_start", .shapes = kShapes, .steps = 5,
         .bucket_bytes = 12 << 10, .first_bucket_bytes = 12 << 10};
  c.options.matrix_approximation_rank = 2;
  c.options.start_powerSGD_iter = 2;
  c.options.use_error_feedback = false;
  c.options.warm_start = false;
  c.options.random_seed = 3;
  out.push_back(c);
  // Gradients as views into the buckets: the hook writes the result where .grad already is.
  Case d = b;
  d.name = "rank4_bucket_views";
  d.bucket_views = true;
  out.push_back(d);
  return out;
}

// [step][rank][param]: the local gradient fed in, and the averaged gradient DDP produced.
struct Trace {
  std::vector<std::vector<std::vector<at::Tensor>>> local, averaged;
};

std::string shapes_arg(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<std::string> parts;
  for (const auto& s : shapes) parts.push_back(fmt::format("{}", fmt::join(s, "x")));
  return fmt::format("{}", fmt::join(parts, ","));
}

// PyTorch's hook on the case, or nullopt with the reason when python3-torch is missing.
std::optional<Trace> python_trace(const Case& c, std::string* why) {
  if (!fs::exists(kPython)) {
    *why = fmt::format("{} not found (apt-get install python3-torch)", kPython);
    return std::nullopt;
  }
  TempDir dir("ddp_test_powersgd");
  const fs::path out = dir.path() / "reference.bin";
  const PowerSGDOptions& o = c.options;
  auto r = ddp::testing::run_command(
      {.argv = {kPython, "-E", DDP_POWERSGD_REFERENCE, out.string(), "--shapes",
                shapes_arg(c.shapes), "--steps", std::to_string(c.steps), "--rank",
                std::to_string(o.matrix_approximation_rank), "--start",
                std::to_string(o.start_powerSGD_iter), "--min-rate",
                fmt::format("{}", o.min_compression_rate), "--error-feedback",
                std::to_string(o.use_error_feedback), "--warm-start",
                std::to_string(o.warm_start), "--epsilon",
                fmt::format("{}", o.orthogonalization_epsilon), "--seed",
                std::to_string(o.random_seed), "--batch",
                std::to_string(o.batch_tensors_with_same_shape), "--bucket-bytes",
                std::to_string(c.bucket_bytes), "--first-bucket-bytes",
                std::to_string(c.first_bucket_bytes)},
       .env = {{"OMP_NUM_THREADS", "1"}},
       .timeout_s = 120});
  if (r.exit_code != 0 && r.err.find("No module named 'torch'") != std::string::npos) {
    *why = "python3 cannot import torch (apt-get install python3-torch)";
    return std::nullopt;
  }
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  if (r.exit_code != 0) return std::nullopt;
  std::ifstream in(out, std::ios::binary);
  Trace t;
  for (int s = 0; s < c.steps; ++s) {
    t.local.emplace_back(kWorld);
    t.averaged.emplace_back(kWorld);
    for (int rank = 0; rank < kWorld; ++rank) {
      for (const auto& shape : c.shapes) {
        for (auto* into : {&t.local[s][rank], &t.averaged[s][rank]}) {
          at::Tensor v = torch::empty(shape);
          in.read(reinterpret_cast<char*>(v.data_ptr()), v.numel() * sizeof(float));
          into->push_back(v);
        }
      }
    }
  }
  EXPECT_TRUE(in.good()) << "the reference file is shorter than the case";
  return t;
}

DistributedDataParallel<ParamsImpl> wrap(Params& net, const Case& c,
                                         std::shared_ptr<ProcessGroup> pg) {
  ddp::DDPOptions o;
  o.process_group = std::move(pg);
  o.bucket_cap_mb = static_cast<double>(c.bucket_bytes) / (1 << 20);
  o.first_bucket_mb = static_cast<double>(c.first_bucket_bytes) / (1 << 20);
  o.gradient_as_bucket_view = c.bucket_views;
  return DistributedDataParallel<ParamsImpl>(net.ptr(), o);
}

// Our DDP with our hook on the same local gradients: the averaged gradients, [step][rank][param].
std::vector<std::vector<std::vector<at::Tensor>>> our_averages(const Case& c, const Trace& ref) {
  std::vector<std::vector<std::vector<at::Tensor>>> got(c.steps,
                                                        std::vector<std::vector<at::Tensor>>(kWorld));
  const int port = ddp::testing::free_port();
  auto errors = ddp::testing::run_threads(kWorld, [&](int r) {
    auto pg = ddp::make_process_group(ddp::testing::thread_rank(r, kWorld, port));
    Params net(c.shapes);
    auto model = wrap(net, c, pg);
    auto state = std::make_shared<PowerSGDState>(c.options);
    model.register_comm_hook(ddp::comm_hooks::powerSGD_hook(state));
    for (int s = 0; s < c.steps; ++s) {
      net->zero_grad();
      model(ref.local[s][r]).backward();
      for (const at::Tensor& p : net->params) got[s][r].push_back(p.grad().clone());
    }
    pg->barrier().wait();
  });
  for (int r = 0; r < kWorld; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << ddp::testing::message_of(errors[r]);
  }
  return got;
}

class PowerSGD : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_P(PowerSGD, AveragedGradientsEqualPyTorchsHook) {
  const Case& c = GetParam();
  std::string why;
  const auto ref = python_trace(c, &why);
  if (!ref) {
    if (!why.empty()) GTEST_SKIP() << why;
    return;  // the failure is already recorded
  }
  const auto got = our_averages(c, *ref);
  int compressed_seen = 0;
  double worst = 0;
  for (int s = 0; s < c.steps; ++s) {
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ(got[s][r].size(), c.shapes.size()) << "step " << s << " rank " << r;
      for (size_t i = 0; i < c.shapes.size(); ++i) {
        const at::Tensor& want = ref->averaged[s][r][i];
        const at::Tensor& have = got[s][r][i];
        const double diff = (have - want).abs().max().item<double>();
        const double scale = std::max(1.0, want.abs().max().item<double>());
        worst = std::max(worst, diff / scale);
        EXPECT_LE(diff, 1e-5 * scale)
            << c.name << ": step " << s << " rank " << r << " parameter " << i << " "
            << fmt::format("{}", c.shapes[i]) << ": ours differs from PyTorch's by " << diff;
        // Not a comparison of two plain all-reduces: from start_powerSGD_iter on, compressed
        // matrices differ from the exact mean.
        const at::Tensor mean = (ref->local[s][0][i] + ref->local[s][1][i]) / 2;
        const bool exact = torch::allclose(want, mean, 1e-5, 1e-6);
        if (s < c.options.start_powerSGD_iter) {
          EXPECT_TRUE(exact) << "step " << s << " is before compression starts";
        } else if (!exact) {
          ++compressed_seen;
        }
      }
    }
  }
  EXPECT_GT(compressed_seen, 0) << "no gradient was compressed: the case tests nothing";
  std::printf("%s: %d compressed gradients, largest difference from PyTorch %.3g (relative)\n",
              c.name.c_str(), compressed_seen, worst);
}

INSTANTIATE_TEST_SUITE_P(Cases, PowerSGD, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Steps with an optimizer (so parameters move), a checkpoint after `save_after` steps.
TEST(PowerSGDCheckpoint, ResumeContinuesBitwise) {
  torch::set_num_threads(1);
  Case c{.name = "resume", .shapes = kShapes, .steps = 8, .bucket_bytes = 10 << 10,
         .first_bucket_bytes = 6 << 10};
  c.options.start_powerSGD_iter = 2;
  c.options.matrix_approximation_rank = 2;
  constexpr int kSaveAfter = 4;
  TempDir dir("ddp_test_powersgd_resume");
  auto grads_for = [&](int s, int r) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + 100 * s + r);
    std::vector<at::Tensor> g;
    for (const auto& shape : c.shapes) g.push_back(at::randn(shape, gen, at::kFloat));
    return g;
  };
  // Runs steps [first, last); loads the checkpoint first when `resume`; saves after kSaveAfter.
  auto run = [&](int first, int last, bool resume) {
    std::vector<std::vector<at::Tensor>> finals(kWorld);
    const int port = ddp::testing::free_port();
    auto errors = ddp::testing::run_threads(kWorld, [&](int r) {
      auto pg = ddp::make_process_group(ddp::testing::thread_rank(r, kWorld, port));
      Params net(c.shapes);
      auto model = wrap(net, c, pg);
      auto state = std::make_shared<PowerSGDState>(c.options);
      model.register_comm_hook(ddp::comm_hooks::powerSGD_hook(state));
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      ddp::Checkpointer ckpt(dir.path(), {});
      // The wrapper (its module and DDP's bucket order), the optimizer, the hook's state.
      ddp::TrainingState saved;
      saved.add("model", model);
      saved.add("optimizer", opt);
      saved.add("powersgd", *state);
      if (resume) {
        const ddp::ResumePoint found = ckpt.latest_valid(*pg);
        ASSERT_TRUE(found.path.has_value());
        ckpt.load(*found.path, saved, *pg);
        EXPECT_EQ(state->iter(), kSaveAfter);
      }
      for (int s = first; s < last; ++s) {
        opt.zero_grad();
        model(grads_for(s, r)).backward();
        opt.step();
        if (s + 1 == kSaveAfter && !resume) ckpt.save(saved, {.step = s + 1}, *pg);
      }
      for (const at::Tensor& p : net->params) finals[r].push_back(p.detach().clone());
      pg->barrier().wait();
    });
    for (int r = 0; r < kWorld; ++r) {
      if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << ddp::testing::message_of(errors[r]);
    }
    return finals;
  };
  const auto whole = run(0, c.steps, false);
  const auto resumed = run(kSaveAfter, c.steps, true);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(resumed[r].size(), whole[r].size());
    for (size_t i = 0; i < whole[r].size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed[r][i], whole[r][i]))
          << "rank " << r << " parameter " << i << " differs after the resume by "
          << (resumed[r][i] - whole[r][i]).abs().max().item<double>();
    }
  }
}

// A weight whose gradient is zero on every rank (unused, frozen): with epsilon 0, PyTorch's hook
// divides by zero and trains on NaN; ours stops every rank at the same stage with an error that
// names the fix, and with the epsilon set the gradients stay finite.
TEST(PowerSGDZeroGradient, IsAClearErrorOnEveryRankAndTheEpsilonFixesIt) {
  torch::set_num_threads(1);
  Case c{.name = "zero", .shapes = kShapes};
  c.options.start_powerSGD_iter = 2;
  for (const double eps : {0.0, 1e-8}) {
    SCOPED_TRACE(fmt::format("orthogonalization_epsilon {}", eps));
    c.options.orthogonalization_epsilon = eps;
    std::vector<std::string> errors(kWorld);
    std::vector<bool> finite(kWorld, true);
    const int port = ddp::testing::free_port();
    auto failed = ddp::testing::run_threads(kWorld, [&](int r) {
      auto pg = ddp::make_process_group(ddp::testing::thread_rank(r, kWorld, port));
      Params net(c.shapes);
      auto model = wrap(net, c, pg);
      model.register_comm_hook(
          ddp::comm_hooks::powerSGD_hook(std::make_shared<PowerSGDState>(c.options)));
      for (int s = 0; s < 4 && errors[r].empty(); ++s) {
        std::vector<at::Tensor> grads;
        for (const auto& shape : c.shapes) grads.push_back(torch::randn(shape));
        grads[0].zero_();  // the first weight: zero on every rank
        net->zero_grad();
        try {
          model(grads).backward();
        } catch (const ddp::Error& e) {
          errors[r] = e.what();
          continue;
        }
        for (const at::Tensor& p : net->params) finite[r] = finite[r] && p.grad().isfinite().all().item<bool>();
      }
    });
    for (int r = 0; r < kWorld; ++r) {
      if (failed[r]) ADD_FAILURE() << "rank " << r << ": " << ddp::testing::message_of(failed[r]);
      if (eps == 0) {
        EXPECT_NE(errors[r].find("is all zero"), std::string::npos) << "rank " << r << ": " << errors[r];
        EXPECT_NE(errors[r].find("orthogonalization_epsilon (e.g. 1e-8)"), std::string::npos)
            << errors[r];
      } else {
        EXPECT_EQ(errors[r], "") << "rank " << r;
        EXPECT_TRUE(finite[r]) << "rank " << r << " got non-finite gradients";
      }
    }
  }
}

TEST(PowerSGDState, RefusesOptionsPyTorchRefuses) {
  auto message = [](PowerSGDOptions o) {
    try {
      PowerSGDState s(o);
    } catch (const ddp::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message({.start_powerSGD_iter = 1}).find("must be > 1"), std::string::npos)
      << message({.start_powerSGD_iter = 1});
  EXPECT_EQ(message({.start_powerSGD_iter = 1, .use_error_feedback = false, .warm_start = false}),
            "(accepted)");
  EXPECT_NE(message({.matrix_approximation_rank = 0}).find("at least 1"), std::string::npos);
  EXPECT_NE(message({.min_compression_rate = -1}).find("min_compression_rate"), std::string::npos);
  EXPECT_NE(message({.orthogonalization_epsilon = std::nan("")}).find("epsilon"),
            std::string::npos);
}

TEST(PowerSGDState, LoadChecksTheOptionsBeforeChangingAnything) {
  PowerSGDState saved({.matrix_approximation_rank = 2, .start_powerSGD_iter = 5});
  const std::string bytes = saved.state_dict();
  PowerSGDState other({.matrix_approximation_rank = 4, .start_powerSGD_iter = 5});
  try {
    other.load_state_dict(bytes);
    FAIL() << "a state saved at rank 2 loaded into a rank-4 hook";
  } catch (const ddp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("matrix_approximation_rank = 2, but this run has 4"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(other.load_state_dict("not a state"), ddp::Error);
  PowerSGDState same({.matrix_approximation_rank = 2, .start_powerSGD_iter = 5});
  same.load_state_dict(bytes);
  EXPECT_EQ(same.iter(), 0);
}

TEST(ChainedFuture, StagesRunInOrderWhenWaitedForAndErrorsStick) {
  auto pg = ddp::testing::one_rank_group();
  std::vector<std::string> log;
  at::Tensor t = torch::ones({4});
  ddp::Future first(pg->all_reduce(t, ddp::ReduceOp::kSum), t);
  ddp::Future chain = first
                          .then([&](at::Tensor v) {
                            log.push_back("second");
                            v.mul_(3);
                            return ddp::Future(pg->all_reduce(v, ddp::ReduceOp::kSum), v);
                          })
                          .then([&](at::Tensor v) {
                            log.push_back("third");
                            return ddp::Future::completed(v + 1);
                          });
  EXPECT_TRUE(log.empty()) << "a stage ran before the chain was waited for";
  EXPECT_FALSE(chain.is_completed());
  EXPECT_TRUE(torch::equal(chain.wait(), torch::full({4}, 4.0f)));
  EXPECT_TRUE(torch::equal(chain.wait(), torch::full({4}, 4.0f)));  // idempotent
  EXPECT_EQ(log, (std::vector<std::string>{"second", "third"}));
  EXPECT_TRUE(chain.is_completed());

  int runs = 0;
  ddp::Future failing = ddp::Future::completed(t).then([&](at::Tensor) -> ddp::Future {
    ++runs;
    throw ddp::Error("stage failed");
  });
  EXPECT_THROW(failing.wait(), ddp::Error);
  EXPECT_THROW(failing.wait(), ddp::Error);
  EXPECT_EQ(runs, 1);
}

}  // namespace
