// Every collective, at world sizes 1, 2, 3 and 4, with ranks as threads over Gloo; timeouts and
// failures name the rank, the operation and its sequence number.
#include <signal.h>

#include <latch>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/distributed.h"
#include "ddp/error.h"
#include "process_group/cuda_device.h"
#include "process_group/transport/transport.h"  // capabilities_of
#include "support/ranks.h"

namespace ddp {
namespace {

using namespace std::chrono_literals;
using testing::run_ranks;

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllReduceEveryOp) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const float r = static_cast<float>(pg.rank());
    // Each element differs so a reduction over the wrong axis would show.
    auto make = [&] { return torch::arange(5, torch::kFloat) + r * 10; };
    const auto base = torch::arange(5, torch::kFloat);
    const float rank_sum = 10.0f * n * (n - 1) / 2;

    auto t = make();
    pg.all_reduce(t, ReduceOp::kSum).wait();
    EXPECT_TRUE(torch::allclose(t, base * n + rank_sum)) << t;

    t = make();
    pg.all_reduce(t, ReduceOp::kAvg).wait();
    EXPECT_TRUE(torch::allclose(t, base + rank_sum / n)) << t;

    t = make();
    pg.all_reduce(t, ReduceOp::kMax).wait();
    EXPECT_TRUE(torch::equal(t, base + 10.0f * (n - 1))) << t;

    t = make();
    pg.all_reduce(t, ReduceOp::kMin).wait();
    EXPECT_TRUE(torch::equal(t, base)) << t;

    auto counts = torch::full({3}, pg.rank() + 1, torch::kLong);
    pg.all_reduce(counts, ReduceOp::kSum).wait();
    EXPECT_EQ(counts[0].item<int64_t>(), n * (n + 1) / 2);
  });
}

TEST_P(Collectives, BroadcastFromEveryRoot) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    for (int root = 0; root < n; ++root) {
      auto t = torch::full({2, 3}, static_cast<double>(pg.rank()), torch::kDouble);
      pg.broadcast(t, root).wait();
      EXPECT_TRUE(torch::equal(t, torch::full({2, 3}, static_cast<double>(root), torch::kDouble)));
    }
  });
}

TEST_P(Collectives, AllGather) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    auto in = torch::tensor({pg.rank(), pg.rank() * 100}, torch::kInt);
    std::vector<at::Tensor> out(n);
    for (auto& o : out) o = torch::empty_like(in);
    pg.all_gather(out, in).wait();
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(torch::equal(out[r], torch::tensor({r, r * 100}, torch::kInt))) << r;
    }
  });
}

// bfloat16 on every transport: moved exactly by broadcast and all_gather (LibTorch 1.13's Gloo
// refuses the dtype: it goes as its int16 bytes); all_reduce where the transport reduces it,
// else one clear line before anything is sent, and the group goes on.
TEST_P(Collectives, BFloat16MovesEverywhereAndReducesWhereDeclared) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const auto value = [](int r) { return torch::full({5}, 1.5 + r, torch::kBFloat16); };
    auto t = value(pg.rank());
    pg.broadcast(t, n - 1).wait();
    EXPECT_TRUE(torch::equal(t, value(n - 1)));
    std::vector<at::Tensor> out(n);
    for (auto& o : out) o = torch::empty({5}, torch::kBFloat16);
    pg.all_gather(out, value(pg.rank())).wait();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(torch::equal(out[r], value(r))) << r;
    t = value(pg.rank());
    if (capabilities_of(pg).can_reduce(DType::kBF16)) {
      pg.all_reduce(t, ReduceOp::kSum).wait();
      EXPECT_EQ(t[0].item<float>(), 1.5f * n + n * (n - 1) / 2.0f) << pg.backend();
    } else {
      try {
        pg.all_reduce(t, ReduceOp::kSum).wait();
        ADD_FAILURE() << "no error on " << pg.backend();
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("cannot reduce BFloat16 tensors"), std::string::npos)
            << e.what();
      }
    }
    auto ones = torch::ones({2});
    pg.all_reduce(ones).wait();
    EXPECT_EQ(ones[0].item<float>(), n);
  });
}

TEST_P(Collectives, ReduceScatter) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    // inputs[j] on rank r holds r + 10 j: rank j's output sums r over ranks.
    std::vector<at::Tensor> inputs;
    for (int j = 0; j < n; ++j) {
      inputs.push_back(torch::full({2, 2}, static_cast<float>(pg.rank() + 10 * j)));
    }
    const float me = static_cast<float>(pg.rank());
    const float rank_sum = n * (n - 1) / 2.0f;
    auto out = torch::empty({2, 2});
    pg.reduce_scatter(out, inputs, ReduceOp::kSum).wait();
    EXPECT_TRUE(torch::allclose(out, torch::full({2, 2}, rank_sum + 10 * me * n))) << out;
    pg.reduce_scatter(out, inputs, ReduceOp::kAvg).wait();
    EXPECT_TRUE(torch::allclose(out, torch::full({2, 2}, rank_sum / n + 10 * me))) << out;
    pg.reduce_scatter(out, inputs, ReduceOp::kMax).wait();
    EXPECT_TRUE(torch::allclose(out, torch::full({2, 2}, (n - 1) + 10 * me))) << out;
  });
}

TEST_P(Collectives, BarrierWaitsForTheLastRank) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const auto start = std::chrono::steady_clock::now();
    if (pg.rank() == n - 1) std::this_thread::sleep_for(300ms);
    pg.barrier().wait();
    if (n > 1) EXPECT_GE(std::chrono::steady_clock::now() - start, 250ms);
  });
}

TEST_P(Collectives, ManyInFlightWaitedInReverseWithSequenceNumbers) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const uint64_t before = pg.last_sequence_number();
    std::vector<at::Tensor> ts;
    std::vector<Work> works;
    for (int i = 0; i < 8; ++i) {
      ts.push_back(torch::full({1000}, static_cast<float>(i)));
      works.push_back(pg.all_reduce(ts.back()));
    }
    EXPECT_EQ(pg.last_sequence_number(), before + 8);
    EXPECT_NE(works[7].description().find(fmt::format("all_reduce #{}", before + 8)),
              std::string::npos)
        << works[7].description();
    for (int i = 7; i >= 0; --i) works[i].wait();
    for (int i = 0; i < 8; ++i) {
      EXPECT_TRUE(works[i].is_completed());
      EXPECT_TRUE(torch::allclose(ts[i], torch::full({1000}, static_cast<float>(i * n))));
      works[i].wait();  // a second wait returns at once
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(CollectiveErrors, TimeoutFiresAndNamesTheOperation) {
  const int port = testing::free_port();
  std::latch rank0_done(1);
  double waited_s = 0;
  std::string message;
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port, /*timeout=*/1s));
    if (r == 0) {
      auto t = torch::ones({4});
      const auto start = std::chrono::steady_clock::now();
      try {
        pg->all_reduce(t).wait();
      } catch (const TimeoutError& e) {
        message = e.what();
      }
      waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      rank0_done.count_down();
    } else {
      rank0_done.wait();  // rank 1 never joins the all_reduce
    }
  });
  EXPECT_FALSE(errors[0]) << testing::message_of(errors[0]);
  EXPECT_FALSE(errors[1]) << testing::message_of(errors[1]);
  EXPECT_GE(waited_s, 0.9);
  EXPECT_LT(waited_s, 5.0);
  for (const char* needle : {"[rank 0]", "all_reduce #1", "timed out", "DDP_COLLECTIVE_TIMEOUT"}) {
    EXPECT_NE(message.find(needle), std::string::npos) << needle << " not in: " << message;
  }
}

TEST(CollectiveErrors, PeerGoneFailsFastNotAtTheTimeout) {
  const int port = testing::free_port();
  double waited_s = 0;
  std::string message;
  std::latch rank1_gone(1);
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port, /*timeout=*/60s));
    if (r == 1) {
      pg.reset();  // closes its sockets, as a crashed process would
      rank1_gone.count_down();
      return;
    }
    rank1_gone.wait();
    auto t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->all_reduce(t).wait();
    } catch (const CollectiveError& e) {
      message = e.what();
    }
    waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  EXPECT_FALSE(errors[0]) << testing::message_of(errors[0]);
  EXPECT_LT(waited_s, 10.0);
  EXPECT_NE(message.find("[rank 0] all_reduce #1"), std::string::npos) << message;
}

// Note [SIGPIPE]: a process in a group ignores SIGPIPE (it had the default action), so a peer's
// closed socket is an error with a message, not a silent death by signal.
// A handler the program installed is kept.
void count_sigpipe(int) {}

TEST(CollectiveErrors, AGroupIgnoresSigpipeSoAClosedPeerIsAnError) {
  auto disposition = [] {
    struct sigaction now {};
    EXPECT_EQ(::sigaction(SIGPIPE, nullptr, &now), 0);
    return now.sa_handler;
  };
  ::signal(SIGPIPE, SIG_DFL);
  run_ranks(2, [](ProcessGroup&) {});
  EXPECT_EQ(disposition(), SIG_IGN);
  ::signal(SIGPIPE, count_sigpipe);
  run_ranks(2, [](ProcessGroup&) {});
  EXPECT_EQ(disposition(), &count_sigpipe);
  ::signal(SIGPIPE, SIG_IGN);
}

TEST(CollectiveErrors, BadArgumentsAreNamedBeforeAnythingIsSent) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto t = torch::ones({3});
    std::vector<at::Tensor> one{torch::empty({3})};
    EXPECT_THROW(
        {
          try {
            auto w = pg.all_gather(one, t);
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("expected 2 output tensors"), std::string::npos);
            throw;
          }
        },
        Error);
    EXPECT_THROW(auto w = pg.broadcast(t, 2), Error);
    auto ints = torch::ones({3}, torch::kInt);
    EXPECT_THROW(auto w = pg.all_reduce(ints, ReduceOp::kAvg), Error);
    at::Tensor undefined;
    EXPECT_THROW(auto w = pg.all_reduce(undefined), Error);
    std::vector<at::Tensor> wrong_shape{torch::empty({3}), torch::empty({4})};
    auto out = torch::empty({3});
    EXPECT_THROW(auto w = pg.reduce_scatter(out, wrong_shape), Error);
  });
}

// Note [Device binding]: a device that does not exist is named with what is visible; the CPU
// backends bind none unless asked; nccl without NCCL compiled in says so.
TEST(DeviceBinding, ChoosesLocalRankOrTheRequestedDeviceAndNamesAMissingOne) {
  EXPECT_EQ(choose_cuda_device(std::nullopt, 1, 2, /*needs_cuda=*/true, 5), 1);
  EXPECT_EQ(choose_cuda_device(0, 1, 2, true, 5), 0);
  EXPECT_EQ(choose_cuda_device(std::nullopt, 1, 2, /*needs_cuda=*/false, 5), std::nullopt);
  EXPECT_EQ(choose_cuda_device(1, 3, 2, false, 5), 1);
  try {
    choose_cuda_device(std::nullopt, 2, 2, true, 5);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[rank 5] the nccl backend needs one GPU per rank, but "
                                         "LOCAL_RANK 2 has none: 2 CUDA devices are visible"),
              std::string::npos)
        << e.what();
  }
  if (torch::cuda::is_available()) return;
  InitOptions o = testing::one_rank_options();
  o.device_id = 0;
  try {
    make_process_group(o);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[rank 0] InitOptions::device_id 0 does not exist: 0 "
                                         "CUDA devices are visible"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(testing::one_rank_group()->bound_device_id(), std::nullopt);
}

TEST(DefaultGroup, FreeFunctionsWithoutAndWithAGroup) {
  EXPECT_FALSE(is_initialized());
  EXPECT_EQ(get_rank(), 0);
  EXPECT_EQ(get_world_size(), 1);
  EXPECT_TRUE(is_main_process());
  auto t = torch::ones({2});
  EXPECT_THROW(all_reduce(t), Error);

  InitOptions o;
  o.rank = 0;
  o.world_size = 1;
  auto pg = init_process_group(o);
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(default_group(), pg);
  EXPECT_EQ(pg->backend(), "shm");  // "auto": every rank (the one) is on this host
  EXPECT_THROW(init_process_group(o), Error);
  all_reduce(t);
  broadcast(t, 0);
  barrier();
  std::vector<at::Tensor> out{torch::empty({2})};
  all_gather(out, t);
  EXPECT_TRUE(torch::equal(out[0], t));
  destroy_process_group();
  EXPECT_FALSE(is_initialized());
  EXPECT_THROW(default_group(), Error);
}

}  // namespace
}  // namespace ddp
