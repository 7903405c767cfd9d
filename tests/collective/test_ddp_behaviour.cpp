// DDP behaviour beyond the numbers: errors (with their messages, and without hangs), comm
// hooks, observable overlap, bucket rebuild, debug logs, default group.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/distributed.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/error.h"
#include "support/models.h"
#include "support/ranks.h"

namespace ddp {
namespace {

using namespace ddp::testing;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

void expect_contains(const std::string& message, std::initializer_list<std::string> needles) {
  for (const auto& n : needles) {
    EXPECT_NE(message.find(n), std::string::npos) << "'" << n << "' not in: " << message;
  }
}

// Runs fn(rank, group) on `world` thread-ranks; returns each rank's exception.
std::vector<std::exception_ptr> on_ranks(
    int world, const std::function<void(int, std::shared_ptr<ProcessGroup>)>& fn) {
  const int port = free_port();
  return run_threads(world, [&](int r) {
    auto pg = make_process_group(thread_rank(r, world, port, /*timeout=*/20s));
    fn(r, pg);
  });
}

void expect_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_FALSE(errors[r]) << "rank " << r << ": " << message_of(errors[r]);
  }
}

class Behaviour : public ::testing::Test {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_F(Behaviour, UnusedParameterWithoutTheFlagIsAnErrorNotAHang) {
  const auto start = Clock::now();
  std::vector<std::string> messages(2);
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    auto net = Branchy();
    DistributedDataParallel model(net.ptr(), {.process_group = pg});
    auto loss = model(torch::randn({4, 20}), std::vector<bool>{false}).sum();
    try {
      loss.backward();
    } catch (const std::exception& e) {
      messages[r] = e.what();
    }
    pg->barrier().wait();
  });
  expect_no_errors(errors);
  for (int r = 0; r < 2; ++r) {
    expect_contains(messages[r], {fmt::format("[rank {}]", r), "branch.weight", "branch.bias",
                                  "never.weight", "find_unused_parameters=true"});
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 15.0);
}

TEST_F(Behaviour, SecondBackwardAfterOneForwardIsAnError) {
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    auto net = Mlp();
    DistributedDataParallel model(net.ptr(), {.process_group = pg});
    auto loss = model(torch::randn({4, 20})).sum();
    loss.backward({}, /*retain_graph=*/true);
    try {
      loss.backward();
      ADD_FAILURE() << "second backward was accepted";
    } catch (const std::exception& e) {
      expect_contains(e.what(),
                      {fmt::format("[rank {}]", r), "already reduced", "exactly one backward"});
    }
    // The next iteration works normally.
    model(torch::randn({4, 20})).sum().backward();
    pg->barrier().wait();
  });
  expect_no_errors(errors);
}

TEST_F(Behaviour, DifferentModelsAcrossRanksNameTheFirstDifference) {
  std::vector<std::string> messages(2);
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    auto net = Mlp(r == 0 ? 32 : 33);
    try {
      DistributedDataParallel model(net.ptr(), {.process_group = pg});
    } catch (const Error& e) {
      messages[r] = e.what();
    }
  });
  expect_no_errors(errors);
  expect_contains(messages[0], {"[rank 0]", "ranks [1] differ from rank 0"});
  expect_contains(messages[1], {"[rank 1]", "fc1.weight", "[33, 20]", "[32, 20]"});
}

// Gradients of one backward with `hook` and without, on the same weights and data.
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> grads_with_hook(
    int r, std::shared_ptr<ProcessGroup> pg, CommHook hook) {
  torch::manual_seed(3);  // same weights everywhere (init_sync would copy rank 0's anyway)
  auto exact_net = Mlp();
  auto hooked_net = Mlp();
  copy_state(*exact_net, *hooked_net);
  DistributedDataParallel exact(exact_net.ptr(), {.process_group = pg});
  DistributedDataParallel hooked(hooked_net.ptr(), {.process_group = pg});
  hooked.register_comm_hook(std::move(hook));
  torch::manual_seed(100 + r);
  auto x = torch::randn({8, 20}) * 10;
  exact(x).pow(2).sum().backward();
  hooked(x).pow(2).sum().backward();
  std::vector<torch::Tensor> a, b;
  for (auto& p : exact_net->parameters()) a.push_back(p.grad().clone());
  for (auto& p : hooked_net->parameters()) b.push_back(p.grad().clone());
  return {a, b};
}

void check_compression(CommHook hook, double relative_precision) {
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    auto [exact, hooked] = grads_with_hook(r, pg, hook);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      worst = std::max(worst, (exact[i] - hooked[i]).abs().max().item<double>());
      scale = std::max(scale, exact[i].abs().max().item<double>());
    }
    EXPECT_LE(worst, relative_precision * scale) << "scale " << scale;
    EXPECT_GT(worst, 0.0) << "the hook did not change anything: was it applied?";
  });
  expect_no_errors(errors);
}

TEST_F(Behaviour, Fp16CompressionStaysWithinHalfPrecision) {
  check_compression(comm_hooks::fp16_compress(), std::ldexp(1.0, -10));
}

TEST_F(Behaviour, Bf16CompressionStaysWithinBfloat16Precision) {
  check_compression(comm_hooks::bf16_compress(), std::ldexp(1.0, -7));
}

TEST_F(Behaviour, CustomHookSeesUndividedBucketsAndDecidesTheResult) {
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    auto [exact, hooked] = grads_with_hook(r, pg, [](GradBucket& b) {
      // The sum over ranks instead of the mean: twice the default result at 2 ranks.
      return Future(b.process_group().all_reduce(b.buffer()), b.buffer());
    });
    for (size_t i = 0; i < exact.size(); ++i) {
      EXPECT_TRUE(torch::allclose(hooked[i], exact[i] * 2, 1e-5, 1e-6)) << i;
    }
  });
  expect_no_errors(errors);
}

// A Future's transform runs once; when it throws, the error is sticky: a second wait() does not
// hand out the untransformed value.
TEST_F(Behaviour, FutureWhoseTransformThrowsStaysFailed) {
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    int calls = 0;
    auto t = torch::full({4}, static_cast<float>(r + 1));
    Future f(pg->all_reduce(t), t, [&calls](at::Tensor v) -> at::Tensor {
      ++calls;
      throw std::runtime_error("transform failed");
    });
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        f.wait();
        ADD_FAILURE() << "attempt " << attempt << ": wait() returned a value";
      } catch (const std::runtime_error& e) {
        EXPECT_STREQ(e.what(), "transform failed");
      }
    }
    EXPECT_EQ(calls, 1);
    EXPECT_TRUE(f.is_completed());

    // And a transform that succeeds is applied exactly once, however often one waits.
    auto u = torch::ones({2});
    Future g(pg->all_reduce(u), u, [&calls](at::Tensor v) {
      ++calls;
      return v * 10;
    });
    EXPECT_TRUE(torch::equal(g.wait(), torch::full({2}, 20.0f)));
    EXPECT_TRUE(torch::equal(g.wait(), torch::full({2}, 20.0f)));
    EXPECT_EQ(calls, 2);
  });
  expect_no_errors(errors);
}

// Over shm, DDP's buckets are comm buffers: peers reduce them in place, nothing is staged.
TEST_F(Behaviour, BucketsLiveInTheTransportsMemory) {
  std::vector<int> in_place(2, -1);
  ::testing::internal::CaptureStderr();
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    grads_with_hook(r, pg, [&in_place, r](GradBucket& b) {
      in_place[r] = b.process_group().is_comm_buffer(b.buffer());
      return comm_hooks::allreduce()(b);
    });
    DistributedDataParallel logged(Mlp().ptr(), {.process_group = pg, .debug = DebugLevel::kInfo});
  });
  const std::string log = ::testing::internal::GetCapturedStderr();
  expect_no_errors(errors);
  const bool shm = test_backend() == "shm";
  EXPECT_EQ(in_place[0], shm ? 1 : 0) << test_backend();
  EXPECT_EQ(in_place[1], shm ? 1 : 0) << test_backend();
  EXPECT_EQ(log.find("MB, shared memory): ") != std::string::npos, shm) << log;
}

// no_sync(enabled) decides at run time: no_sync(false) reduces as usual, no_sync(true) not.
TEST_F(Behaviour, NoSyncTakesAFlag) {
  std::vector<std::vector<float>> synced(2), local(2);
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    torch::manual_seed(3);
    auto net = Mlp();
    DistributedDataParallel model(net.ptr(), {.process_group = pg});
    torch::manual_seed(100 + r);
    auto x = torch::randn({8, 20});
    for (bool enabled : {false, true}) {
      for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
      {
        auto guard = model.no_sync(enabled);
        model(x).pow(2).sum().backward();
      }
      (enabled ? local : synced)[r].push_back(net->parameters()[0].grad().sum().item<float>());
    }
    model(x).pow(2).sum().backward();  // outside the guard: reduces (keeps the ranks in step)
  });
  expect_no_errors(errors);
  EXPECT_EQ(synced[0], synced[1]) << "no_sync(false) must reduce";
  EXPECT_NE(local[0], local[1]) << "no_sync(true) must not";
}

// A hook runs while DDP holds its lock: calling back into the wrapper is a clear error, never
// a deadlock (ctest's deadline would catch one).
TEST_F(Behaviour, ACommHookThatCallsBackIntoDdpIsAnErrorNotADeadlock) {
  auto pg = one_rank_group();
  auto net = Mlp();
  DistributedDataParallel model(net.ptr(), {.process_group = pg});
  auto* wrapper = &model;
  model.register_comm_hook([wrapper](GradBucket& b) {
    wrapper->bucket_layout();
    return Future::completed(b.buffer());
  });
  std::string message;
  try {
    model(torch::randn({4, 20})).sum().backward();
  } catch (const std::exception& e) {
    message = e.what();
  }
  expect_contains(message, {"[rank 0] DistributedDataParallel: the bucket layout was called "
                            "from inside a comm hook",
                            "use only its GradBucket"});
}

TEST_F(Behaviour, CommHookMustBeRegisteredBeforeTheFirstForward) {
  auto pg = one_rank_group();
  auto net = Mlp();
  DistributedDataParallel model(net.ptr(), {.process_group = pg});
  model(torch::randn({2, 20})).sum().backward();
  EXPECT_THROW(model.register_comm_hook(comm_hooks::fp16_compress()), Error);
}

TEST_F(Behaviour, FirstBucketIsReducedWhileBackwardStillComputesGradients) {
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    auto net = ManySmall();
    DistributedDataParallel model(net.ptr(), {.process_group = pg,
                                              .bucket_cap_mb = 0.0003,
                                              .first_bucket_mb = 0.0001});
    for (int it = 0; it < 3; ++it) {  // the first iteration, then the rebuilt buckets
      model(torch::randn({16, 20})).sum().backward();
      const IterationStats& s = model.last_iteration_stats();
      ASSERT_GE(s.bucket_launch_s.size(), 10u);
      // Bucket 0 (the last layers) started before the first layer's gradient existed.
      EXPECT_GE(s.bucket_launch_s[0], 0.0);
      EXPECT_LT(s.bucket_launch_s[0], s.last_gradient_s) << "iteration " << it;
      EXPECT_LE(s.last_gradient_s, s.finalize_start_s);
      EXPECT_LE(s.finalize_start_s, s.finalize_end_s);
      EXPECT_EQ(s.ready_order.front(), "out.bias");
      EXPECT_EQ(s.ready_order.back(), "in.weight");
    }
  });
  expect_no_errors(errors);
}

// Registered as (a, b) but used as x -> b -> a: gradients are ready a first, then b.
struct OutOfOrderImpl : torch::nn::Module {
  OutOfOrderImpl() {
    a = register_module("a", torch::nn::Linear(16, 16));
    b = register_module("b", torch::nn::Linear(16, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) { return a(torch::relu(b(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(OutOfOrder);

TEST_F(Behaviour, BucketsAreRebuiltOnceInTheObservedReadyOrder) {
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    auto net = OutOfOrder();
    // One tensor per bucket, so the layout is the order.
    DistributedDataParallel model(net.ptr(), {.process_group = pg,
                                              .bucket_cap_mb = 1e-6,
                                              .first_bucket_mb = 1e-6});
    using Layout = std::vector<std::vector<std::string>>;
    const Layout reverse_registration = {{"b.bias"}, {"b.weight"}, {"a.bias"}, {"a.weight"}};
    const Layout observed = {{"a.bias"}, {"a.weight"}, {"b.bias"}, {"b.weight"}};
    EXPECT_EQ(model.bucket_layout(), reverse_registration);
    model(torch::randn({4, 16})).sum().backward();
    EXPECT_EQ(model.bucket_layout(), reverse_registration);  // rebuilt at the next forward
    model(torch::randn({4, 16})).sum().backward();
    EXPECT_EQ(model.bucket_layout(), observed);
  });
  expect_no_errors(errors);
}

TEST_F(Behaviour, ASavedBucketOrderGivesAResumedWrapperTheRebuiltBucketsAtOnce) {
  auto errors = on_ranks(3, [&](int r, std::shared_ptr<ProcessGroup> pg) {
    DDPOptions one_per_bucket{.process_group = pg, .bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6};
    auto net = OutOfOrder();
    DistributedDataParallel model(net.ptr(), one_per_bucket);
    EXPECT_TRUE(model.bucket_order().empty());  // nothing rebuilt yet: nothing to save
    for (int i = 0; i < 2; ++i) model(torch::randn({4, 16})).sum().backward();
    const std::vector<int64_t> saved = model.bucket_order();
    EXPECT_EQ(saved, (std::vector<int64_t>{1, 0, 3, 2}));  // a.bias, a.weight, b.bias, b.weight
    const auto rebuilt = model.bucket_layout();

    // A new process would build a new wrapper: with the saved order it starts where the
    // original run was, and does not rebuild again.
    auto fresh = OutOfOrder();
    DistributedDataParallel resumed(fresh.ptr(), one_per_bucket);
    resumed.restore_bucket_order(saved);
    EXPECT_EQ(resumed.bucket_layout(), rebuilt);
    for (int i = 0; i < 2; ++i) resumed(torch::randn({4, 16})).sum().backward();
    EXPECT_EQ(resumed.bucket_layout(), rebuilt);
    EXPECT_THROW(resumed.restore_bucket_order({0, 1, 2}), Error);  // not this model's
    EXPECT_THROW(resumed.restore_bucket_order({0, 0, 1, 2}), Error);
  });
  expect_no_errors(errors);
}

TEST_F(Behaviour, DebugModeLogsLayoutAndReadyOrder) {
  auto pg = one_rank_group();
  auto net = Mlp();
  ::testing::internal::CaptureStderr();
  {
    DistributedDataParallel model(net.ptr(), {.process_group = pg, .debug = DebugLevel::kDetail});
    model.register_comm_hook(comm_hooks::allreduce());  // world size 1 would pass through
    for (int i = 0; i < 2; ++i) model(torch::randn({2, 20})).sum().backward();
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  expect_contains(log, {"ddp: world size 1: gradients need no reduction",
                        "[rank 0] ddp: initial bucket layout", "fc3.weight",
                        "rebuilt (observed ready order)", "iteration 1 ready order: fc3.bias"});

  setenv("DDP_DEBUG", "loud", 1);
  EXPECT_THROW(DistributedDataParallel(net.ptr(), {.process_group = pg}), ConfigError);
  unsetenv("DDP_DEBUG");
}

TEST_F(Behaviour, WorldSizeOnePassesGradientsThroughWithoutBuckets) {
  auto pg = one_rank_group();
  torch::manual_seed(5);
  auto plain = Mlp();
  auto wrapped = Mlp();
  copy_state(*plain, *wrapped);
  DistributedDataParallel model(wrapped.ptr(), {.process_group = pg});
  EXPECT_TRUE(model.bucket_layout().empty());  // no gradient copy allocated
  auto x = torch::randn({8, 20});
  plain(x).pow(2).sum().backward();
  model(x).pow(2).sum().backward();
  auto a = plain->parameters(), b = wrapped->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].grad(), b[i].grad()));
}

// PyTorch's device_ids: one device, and the module already on it.
TEST_F(Behaviour, DeviceIdsMustNameTheModulesOneDevice) {
  auto pg = one_rank_group();
  auto net = Mlp();
  try {
    DistributedDataParallel model(net.ptr(), {.process_group = pg, .device_ids = {0}});
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[rank 0] DistributedDataParallel: device_ids {0}, but "
                                         "parameter 'fc1.weight' is on cpu; move the module first"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(DistributedDataParallel(net.ptr(), {.process_group = pg, .device_ids = {0, 1}}),
               ConfigError);
}

TEST_F(Behaviour, UsesTheDefaultGroupAndNeedsOne) {
  auto net = Mlp();
  EXPECT_THROW(DistributedDataParallel(net.ptr()), Error);  // no init_process_group yet
  init_process_group(one_rank_options());
  DistributedDataParallel model(net);  // a TORCH_MODULE holder works too
  EXPECT_EQ(&model.process_group(), default_group().get());
  model(torch::randn({2, 20})).sum().backward();
  EXPECT_TRUE(net->fc1->weight.grad().defined());
  destroy_process_group();
}

}  // namespace
}  // namespace ddp
