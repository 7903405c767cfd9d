// Every collective, at world sizes 1, 2, 3 and 4, with ranks as threads over Gloo; timeouts and
// failures name the rank, the operation and its sequence number.
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <latch>
#include <map>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "ddp/config.h"  // DDP_WITH_NCCL
#include "ddp/distributed.h"
#include "ddp/error.h"
#include "process_group/cuda_device.h"
#include "process_group/transport/transport.h"  // capabilities_of
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

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
    if (capabilities_of(pg, c10::DeviceType::CPU).can_reduce(DType::kBF16)) {
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

// The rest of torch.distributed's collectives (Note [Composed collectives] over shm and the
// hierarchy; Gloo's own elsewhere), at every root and world size.
TEST_P(Collectives, ReduceToEveryRootWithEveryOp) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const float r = static_cast<float>(pg.rank());
    const auto base = torch::arange(5, torch::kFloat);
    const float rank_sum = 10.0f * n * (n - 1) / 2;
    for (int root = 0; root < n; ++root) {
      const bool me = pg.rank() == root;
      auto t = base + r * 10;
      pg.reduce(t, root, ReduceOp::kSum).wait();
      if (me) EXPECT_TRUE(torch::allclose(t, base * n + rank_sum)) << t;
      t = base + r * 10;
      pg.reduce(t, root, ReduceOp::kAvg).wait();
      if (me) EXPECT_TRUE(torch::allclose(t, base + rank_sum / n)) << t;
      t = base + r * 10;
      pg.reduce(t, root, ReduceOp::kMax).wait();
      if (me) EXPECT_TRUE(torch::equal(t, base + 10.0f * (n - 1))) << t;
      t = base + r * 10;
      pg.reduce(t, root, ReduceOp::kMin).wait();
      if (me) EXPECT_TRUE(torch::equal(t, base)) << t;
      auto counts = torch::full({3}, pg.rank() + 1, torch::kLong);
      auto w = pg.reduce(counts, root);
      EXPECT_NE(w.description().find(fmt::format("reduce #{} (sum to rank {}, 3 x Long)",
                                                 pg.last_sequence_number(), root)),
                std::string::npos)
          << w.description();
      w.wait();
      if (me) EXPECT_EQ(counts[0].item<int64_t>(), n * (n + 1) / 2);
    }
  });
}

TEST_P(Collectives, GatherToAndScatterFromEveryRoot) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    for (int root = 0; root < n; ++root) {
      const bool me = pg.rank() == root;
      // A non-contiguous input (a transposed view) is gathered by its values.
      auto in = torch::tensor({{pg.rank(), pg.rank() * 100}, {-pg.rank(), root}}, torch::kInt).t();
      std::vector<at::Tensor> out;
      if (me) {
        for (int r = 0; r < n; ++r) out.push_back(torch::empty({2, 2}, torch::kInt));
      }
      pg.gather(out, in, root).wait();
      for (int r = 0; me && r < n; ++r) {
        EXPECT_TRUE(
            torch::equal(out[r], torch::tensor({{r, r * 100}, {-r, root}}, torch::kInt).t()))
            << "from rank " << r << " to " << root << ": " << out[r];
      }

      std::vector<at::Tensor> parts;
      if (me) {
        for (int j = 0; j < n; ++j)
          parts.push_back(torch::full({2, 3}, root * 10.0 + j, torch::kDouble));
      }
      auto got = torch::empty({3, 2}, torch::kDouble).t();  // non-contiguous output
      pg.scatter(got, parts, root).wait();
      EXPECT_TRUE(torch::equal(got, torch::full({2, 3}, root * 10.0 + pg.rank(), torch::kDouble)))
          << got;
    }
  });
}

TEST_P(Collectives, AllToAllSingleEvenAndUneven) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const int me = pg.rank();
    // Even: 2 rows of 3 per peer; input[row][c] = rank * 1000 + row * 10 + c.
    auto cell = torch::arange(3, torch::kFloat).view({1, 3});
    auto rows = torch::arange(2 * n, torch::kFloat).view({2 * n, 1}) * 10;
    auto in = rows + cell + me * 1000.0f;
    auto out = torch::empty({2 * n, 3});
    pg.all_to_all_single(out, in).wait();
    for (int i = 0; i < n; ++i) {
      auto expected = rows.narrow(0, 2 * me, 2) + cell + i * 1000.0f;
      EXPECT_TRUE(torch::equal(out.narrow(0, 2 * i, 2), expected)) << "from rank " << i << out;
    }
    // Uneven: rank s sends (s + d) % 3 rows of 2 to rank d (some none); row k to d holds
    // s * 1000 + d * 100 + [2k, 2k + 1].
    auto sends = [](int s, int d) { return static_cast<int64_t>((s + d) % 3); };
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> chunks;
    for (int d = 0; d < n; ++d) {
      in_splits.push_back(sends(me, d));
      out_splits.push_back(sends(d, me));
      chunks.push_back(torch::arange(2 * sends(me, d), torch::kDouble).view({-1, 2}) + me * 1000.0 +
                       d * 100.0);
    }
    auto uneven_in = torch::cat(chunks);
    int64_t received = 0;
    for (int64_t v : out_splits) received += v;
    auto uneven_out = torch::full({received, 2}, -1.0, torch::kDouble);
    pg.all_to_all_single(uneven_out, uneven_in, out_splits, in_splits).wait();
    int64_t at = 0;
    for (int s = 0; s < n; at += out_splits[s], ++s) {
      auto expected =
          torch::arange(2 * sends(s, me), torch::kDouble).view({-1, 2}) + s * 1000.0 + me * 100.0;
      EXPECT_TRUE(torch::equal(uneven_out.narrow(0, at, out_splits[s]), expected))
          << "from rank " << s << ": " << uneven_out;
    }
  });
}

TEST_P(Collectives, AllToAllOfTensorListsOfAnyShape) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const int me = pg.rank();
    // inputs[d] on rank s: (s + 1) x (d + 1) values s * 1000 + d * 100 + k.
    auto block = [](int s, int d) {
      return (torch::arange((s + 1) * (d + 1), torch::kInt) + s * 1000 + d * 100)
          .view({s + 1, d + 1});
    };
    std::vector<at::Tensor> inputs, outputs;
    for (int d = 0; d < n; ++d) {
      inputs.push_back(block(me, d));
      outputs.push_back(torch::empty({(d + 1) * (me + 1)}, torch::kInt));  // any shape
    }
    pg.all_to_all(outputs, inputs).wait();
    for (int s = 0; s < n; ++s) {
      EXPECT_TRUE(torch::equal(outputs[s], block(s, me).reshape({-1})))
          << "from rank " << s << ": " << outputs[s];
    }
  });
}

TEST_P(Collectives, IntoAndOutOfOneTensor) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const int me = pg.rank();
    auto in = torch::arange(6, torch::kFloat).view({2, 3}) + me * 10.0f;
    auto stacked = torch::empty({n * 2, 3});
    pg.all_gather_into_tensor(stacked, in).wait();
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(torch::equal(stacked.narrow(0, 2 * r, 2),
                               torch::arange(6, torch::kFloat).view({2, 3}) + r * 10.0f));
    }
    // Rank r's chunk j is 4 values r + 10 j + [0, 4): rank j's output sums them over r.
    auto all = (torch::arange(4 * n, torch::kFloat) % 4).view({n, 4}) +
               torch::arange(n, torch::kFloat).view({n, 1}) * 10.0f + me;
    auto out = torch::empty({2, 2});
    pg.reduce_scatter_tensor(out, all.reshape({-1})).wait();
    const float rank_sum = n * (n - 1) / 2.0f;
    auto expected = (torch::arange(4, torch::kFloat) + 10.0f * me) * n + rank_sum;
    EXPECT_TRUE(torch::allclose(out, expected.view({2, 2}))) << out;
  });
}

// bfloat16 moves exactly through the moving ones everywhere (as bytes on LibTorch 1.13's Gloo).
TEST_P(Collectives, BFloat16MovesThroughGatherScatterAndAllToAll) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const auto value = [](int r, int j) {
      return torch::full({3}, 1.5 + r + 0.25 * j, torch::kBFloat16);
    };
    std::vector<at::Tensor> out;
    if (pg.rank() == 0) {
      for (int r = 0; r < n; ++r) out.push_back(torch::empty({3}, torch::kBFloat16));
    }
    pg.gather(out, value(pg.rank(), 0), 0).wait();
    for (int r = 0; r < static_cast<int>(out.size()); ++r)
      EXPECT_TRUE(torch::equal(out[r], value(r, 0)));
    std::vector<at::Tensor> parts;
    if (pg.rank() == n - 1) {
      for (int j = 0; j < n; ++j) parts.push_back(value(n - 1, j));
    }
    auto got = torch::empty({3}, torch::kBFloat16);
    pg.scatter(got, parts, n - 1).wait();
    EXPECT_TRUE(torch::equal(got, value(n - 1, pg.rank())));
    std::vector<at::Tensor> sends;
    for (int d = 0; d < n; ++d) sends.push_back(value(pg.rank(), d));
    auto in = torch::cat(sends);
    auto received = torch::empty({3 * n}, torch::kBFloat16);
    pg.all_to_all_single(received, in).wait();
    for (int s = 0; s < n; ++s)
      EXPECT_TRUE(torch::equal(received.narrow(0, 3 * s, 3), value(s, pg.rank())));
  });
}

// send and recv (Note [Point to point]): a ring of isend/irecv pairs (two ranks exchanging
// both ways, with non-contiguous tensors), messages of one channel in order whatever order
// they are waited in, tags received out of the order they were sent in, a large message, and
// descriptions numbered per channel, the same on both sides.
TEST_P(Collectives, SendAndRecvMatchByPeerTagAndOrder) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "point to point needs two ranks";
  run_ranks(n, [n](ProcessGroup& pg) {
    const int me = pg.rank();
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    auto out = torch::arange(6, torch::kDouble).reshape({2, 3}).t() + 100 * me;  // [3, 2], strided
    auto in = torch::zeros({2, 3}, torch::kDouble).t();
    Work sent = pg.isend(out, next, 0);
    Work got = pg.irecv(in, prev, 0);
    EXPECT_EQ(sent.description(), fmt::format("send #1 (to rank {}, tag 0, 6 x Double)", next));
    EXPECT_EQ(got.description(), fmt::format("recv #1 (from rank {}, tag 0, 6 x Double)", prev));
    got.wait();
    sent.wait();
    EXPECT_TRUE(torch::equal(in, torch::arange(6, torch::kDouble).reshape({2, 3}).t() + 100 * prev))
        << in;

    if (me == 0) {
      std::vector<Work> works;
      for (int i = 0; i < 3; ++i) works.push_back(pg.isend(torch::full({2}, 10.0f + i), 1, 4));
      works.push_back(pg.isend(torch::full({2}, 1.0f), 1, 1));
      works.push_back(pg.isend(torch::full({2}, 2.0f), 1, 2));
      auto big = torch::arange(1 << 20, torch::kFloat);
      works.push_back(pg.isend(big, 1, 9));
      works.push_back(pg.isend(torch::full({3}, 1.5, torch::kBFloat16), 1, 3));
      for (Work& w : works) w.wait();
      EXPECT_EQ(works[2].description(), "send #3 (to rank 1, tag 4, 2 x Float)");
    } else if (me == 1) {
      std::vector<at::Tensor> ordered(3, torch::zeros({2}));
      std::vector<Work> works;
      for (int i = 0; i < 3; ++i) {
        ordered[i] = torch::zeros({2});
        works.push_back(pg.irecv(ordered[i], 0, 4));
      }
      for (int i = 2; i >= 0; --i) works[i].wait();  // waited in reverse: matched by order
      for (int i = 0; i < 3; ++i) EXPECT_EQ(ordered[i][0].item<float>(), 10 + i) << i;
      EXPECT_EQ(works[2].description(), "recv #3 (from rank 0, tag 4, 2 x Float)");
      auto two = torch::zeros({2}), one = torch::zeros({2});
      EXPECT_EQ(pg.recv(two, 0, 2), 0);  // tag 2 first, though sent second
      pg.recv(one, 0, 1);
      EXPECT_EQ(two[1].item<float>(), 2);
      EXPECT_EQ(one[1].item<float>(), 1);
      auto big = torch::empty({1 << 20});
      pg.recv(big, 0, 9);
      EXPECT_TRUE(torch::equal(big, torch::arange(1 << 20, torch::kFloat)));
      auto half = torch::zeros({3}, torch::kBFloat16);
      pg.recv(half, 0, 3);
      EXPECT_TRUE(torch::equal(half, torch::full({3}, 1.5, torch::kBFloat16)));
    }
    // The collectives' numbering is untouched by point to point.
    auto ones = torch::ones({1});
    pg.all_reduce(ones).wait();
    EXPECT_EQ(ones[0].item<float>(), n);
    EXPECT_EQ(pg.last_sequence_number(), 1u);
  });
}

// Work::get_future: the value is the tensor the call wrote (or sent), after its Work; a chain
// of then() stages issues its collectives when waited for, in order on every rank; a stage's
// error comes out of every later wait().
TEST_P(Collectives, GetFutureGivesTheResultAndChains) {
  const int n = GetParam();
  run_ranks(n, [n](ProcessGroup& pg) {
    const int me = pg.rank();
    auto t = torch::full({3}, 1.0f + me);
    Future mean = pg.all_reduce(t).get_future().then([&pg, n](at::Tensor sum) {
      sum.div_(n);
      return pg.broadcast(sum, n - 1).get_future();  // a second collective, at the wait
    });
    EXPECT_FALSE(mean.is_completed());  // its stage has not run
    const at::Tensor got = mean.wait();
    EXPECT_TRUE(got.is_same(t));  // the caller's tensor, not a copy
    EXPECT_TRUE(torch::equal(got, torch::full({3}, (n + 1) / 2.0f))) << got;
    EXPECT_TRUE(mean.is_completed());
    EXPECT_EQ(pg.last_sequence_number(), 2u);

    auto stacked = torch::empty({n, 2});
    const at::Tensor gathered =
        pg.all_gather_into_tensor(stacked, torch::full({2}, 1.0f * me)).get_future().wait();
    EXPECT_TRUE(gathered.is_same(stacked));
    EXPECT_TRUE(torch::equal(gathered.select(1, 0), torch::arange(n, torch::kFloat)));
    EXPECT_FALSE(pg.barrier().get_future().wait().defined());  // nothing to give

    Future failing = pg.all_reduce(t).get_future().then(
        [](at::Tensor) -> Future { throw Error("the stage failed"); });
    for (int i = 0; i < 2; ++i) EXPECT_THROW(failing.wait(), Error);
    if (n >= 2) {
      auto in = torch::zeros({4});
      Work w = me == 0 ? pg.isend(torch::arange(4, torch::kFloat), 1, 5)
                       : (me == 1 ? pg.irecv(in, 0, 5) : Work());
      if (me == 1) {
        EXPECT_TRUE(torch::equal(w.get_future().wait(), torch::arange(4, torch::kFloat)));
      } else if (me == 0) {
        EXPECT_TRUE(torch::equal(w.get_future().wait(), torch::arange(4, torch::kFloat)));
      } else {
        EXPECT_THROW(w.get_future(), Error);  // an empty Work has none
      }
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

// Each mistake is named before anything is sent, on the rank that made it.
TEST(CollectiveErrors, BadArgumentsOfTheRootedCollectivesAreNamed) {
  run_ranks(2, [](ProcessGroup& pg) {
    const uint64_t before = pg.last_sequence_number();
    auto expect_error = [&](const std::function<void()>& call, const std::string& text) {
      try {
        call();
        ADD_FAILURE() << "no error; expected: " << text;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
      }
    };
    auto t = torch::ones({3});
    expect_error([&] { auto w = pg.reduce(t, 2); },
                 "reduce #" + std::to_string(before + 1) +
                     ": root rank 2 is not in this group of 2 ranks");
    std::vector<at::Tensor> two{torch::empty({3}), torch::empty({3})};
    // Both ranks pass a list: the non-root one is wrong (PyTorch's gather_list rule).
    if (pg.rank() == 1) {
      expect_error([&] { auto w = pg.gather(two, t, 0); },
                   "outputs must be empty on every rank but the root (0); this rank passed 2");
    } else {
      std::vector<at::Tensor> one{torch::empty({3})};
      expect_error([&] { auto w = pg.gather(one, t, 0); },
                   "the root needs 2 outputs (one per rank), got 1");
      std::vector<at::Tensor> odd{torch::empty({3}), torch::empty({4})};
      expect_error([&] { auto w = pg.scatter(t, odd, 0); }, "inputs[1] must match [3] Float");
    }
    auto rows = torch::ones({5, 2});
    auto out = torch::empty({5, 2});
    expect_error([&] { auto w = pg.all_to_all_single(out, rows); },
                 "the output has 5 rows along dim 0, not divisible by the 2 ranks");
    expect_error(
        [&] {
          auto w = pg.all_to_all_single(out, rows, {2, 3}, {2, 2});
        },
        "the input split sizes [2, 2] add up to 4, but it has 5 rows");
    expect_error(
        [&] {
          auto w = pg.all_to_all_single(out, rows, {2, 3}, {-1, 6});
        },
        "split size -1 is negative");
    auto wide = torch::empty({5, 3});
    expect_error(
        [&] {
          auto w = pg.all_to_all_single(wide, rows, {2, 3}, {2, 3});
        },
        "need the same dtype and the same sizes past dim 0");
    auto small = torch::empty({3});
    expect_error([&] { auto w = pg.all_gather_into_tensor(small, t); },
                 "the output must be a contiguous Float tensor of 2 x 3 elements");
    expect_error([&] { auto w = pg.reduce_scatter_tensor(t, small); },
                 "the input must be a Float tensor of 2 x 3 elements");
    auto ints = torch::ones({3}, torch::kInt);
    expect_error([&] { auto w = pg.reduce(ints, 0, ReduceOp::kAvg); },
                 "averaging needs a floating-point tensor");
    EXPECT_EQ(pg.last_sequence_number(), before) << "a refused call took a sequence number";
  });
}

TEST(CollectiveErrors, BadArgumentsOfSendAndRecvAreNamedAndTakeNoNumber) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto expect_error = [&](const std::function<void()>& call, const std::string& text) {
      try {
        call();
        ADD_FAILURE() << "no error; expected: " << text;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
      }
    };
    const int me = pg.rank(), peer = 1 - pg.rank();
    auto t = torch::ones({3});
    expect_error([&] { auto w = pg.isend(t, me); },
                 fmt::format("[rank {}] send: destination rank {} is not another rank of this "
                             "group of 2 ranks",
                             me, me));
    expect_error([&] { auto w = pg.irecv(t, 2); },
                 "recv: source rank 2 is not another rank of this group of 2 ranks");
    expect_error([&] { auto w = pg.isend(t, peer, -1); },
                 fmt::format("send to rank {}: tag -1 is outside 0 to 16383", peer));
    expect_error([&] { auto w = pg.irecv(t, peer, 1 << 14); }, "tag 16384 is outside 0 to 16383");
    at::Tensor undefined;
    expect_error([&] { auto w = pg.irecv(undefined, peer); }, "recv: the tensor is undefined");
    // The refused calls took no number on their channel: the first message is #1.
    Work w = me == 0 ? pg.isend(t, 1) : pg.irecv(t, 0);
    EXPECT_NE(w.description().find("#1 ("), std::string::npos) << w.description();
    w.wait();
  });
}

// A recv that no send meets fails at the timeout, naming its channel and number; a sender whose
// group is destroyed right after its send still delivers (its group waits until the message is
// taken); a message of another size or dtype fails its recv naming both (over Gloo, which would
// abort the process, through a header first: Note [Gloo point to point]).
TEST(CollectiveErrors, ARecvWithoutItsSendTimesOutNamingTheChannel) {
  const int port = testing::free_port();
  std::latch rank1_done(1);
  double waited_s = 0;
  std::string message;
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port, /*timeout=*/1s));
    if (r == 1) {
      auto t = torch::zeros({4});
      const auto start = std::chrono::steady_clock::now();
      try {
        pg->recv(t, 0, 3);
      } catch (const TimeoutError& e) {
        message = e.what();
      }
      waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      rank1_done.count_down();
    } else {
      rank1_done.wait();  // rank 0 never sends
    }
  });
  EXPECT_FALSE(errors[0]) << testing::message_of(errors[0]);
  EXPECT_FALSE(errors[1]) << testing::message_of(errors[1]);
  EXPECT_GE(waited_s, 0.9);
  EXPECT_LT(waited_s, 5.0);
  for (const char* needle : {"[rank 1]", "recv #1 (from rank 0, tag 3, 4 x Float)", "timed out",
                             "DDP_COLLECTIVE_TIMEOUT"}) {
    EXPECT_NE(message.find(needle), std::string::npos) << needle << " not in: " << message;
  }
}

// A recv whose sender left without sending fails at once, naming it, where the transport can
// tell (shm: its slot says it destroyed its group); elsewhere it times out as above. Rank 0
// hosts the store, so rank 1 is the one that leaves.
TEST(CollectiveErrors, ARecvWhoseSenderLeftFailsAtOnceNamingIt) {
  const int port = testing::free_port();
  std::latch rank1_left(1);
  double waited_s = 0;
  std::string message, backend;
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port, /*timeout=*/8s));
    if (r == 1) {
      pg.reset();  // leaves without sending
      rank1_left.count_down();
      return;
    }
    backend = pg->backend();
    auto t = torch::zeros({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->recv(t, 1, 2);
    } catch (const CollectiveError& e) {
      message = e.what();
    }
    waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rank1_left.wait();
  });
  EXPECT_FALSE(errors[0]) << testing::message_of(errors[0]);
  EXPECT_FALSE(errors[1]) << testing::message_of(errors[1]);
  EXPECT_NE(message.find("[rank 0] recv #1 (from rank 1, tag 2, 4 x Float)"), std::string::npos)
      << message;
  if (backend != "shm")
    GTEST_SKIP() << backend << " cannot tell that it left; it said: " << message;
  EXPECT_LT(waited_s, 3.0) << message;
  EXPECT_NE(message.find("rank 1 destroyed its process group (or is shutting down) before "
                         "sending it"),
            std::string::npos)
      << message;
}

TEST(CollectiveErrors, ASenderThatLeavesAtOnceStillDelivers) {
  const int port = testing::free_port();
  at::Tensor got = torch::zeros({5}, torch::kLong);
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port));
    if (r == 0) {
      pg->send(torch::arange(5, torch::kLong), 1, 6);
      return;  // its group (and the store it hosts) is destroyed at once
    }
    std::this_thread::sleep_for(300ms);
    pg->recv(got, 0, 6);
  });
  EXPECT_FALSE(errors[0]) << testing::message_of(errors[0]);
  EXPECT_FALSE(errors[1]) << testing::message_of(errors[1]);
  EXPECT_TRUE(torch::equal(got, torch::arange(5, torch::kLong))) << got;
  // A message of another size or dtype fails its recv, naming both, and the group goes on.
  run_ranks(2, [](ProcessGroup& pg) {
    if (pg.rank() == 0) {
      pg.send(torch::ones({8}), 1);
      pg.send(torch::ones({2}, torch::kLong), 1);
      return;
    }
    auto t = torch::zeros({4});
    try {
      pg.recv(t, 0);
      ADD_FAILURE() << "no error";
    } catch (const CollectiveError& e) {
      EXPECT_NE(std::string(e.what()).find("recv #1 (from rank 0, tag 0, 4 x Float) failed: rank "
                                           "0 sent 8 x Float"),
                std::string::npos)
          << e.what();
    }
    auto next = torch::zeros({2}, torch::kLong);
    pg.recv(next, 0);
    EXPECT_EQ(next[1].item<int64_t>(), 1);
  });
}

// The same inputs through python3-torch's torch.distributed over Gloo at world size 3
// (collectives_reference.py): every result PyTorch defines is ours too, to the bit. Calls the
// installed PyTorch's Gloo lacks (1.13: all_to_all of lists, all_gather_into_tensor,
// reduce_scatter_tensor) are checked above by their values instead.
TEST(CollectivesVsPython, SameResultsAsTorchDistributed) {
  namespace fs = std::filesystem;
  const char* python = "/usr/bin/python3";
  if (!fs::exists(python))
    GTEST_SKIP() << "SKIPPED: " << python << " not found (apt-get install python3-torch)";
  const fs::path dir = testing::make_temp_dir("ddp_collectives_ref");
  const fs::path json_path = dir / "reference.json";
  auto r =
      testing::run_command({.argv = {python, "-E", DDP_COLLECTIVES_REFERENCE, json_path.string()},
                            .env = {{"OMP_NUM_THREADS", "1"}},
                            .timeout_s = 120});
  if (r.exit_code != 0 && r.err.find("No module named 'torch'") != std::string::npos) {
    fs::remove_all(dir);
    GTEST_SKIP() << "SKIPPED: python3 cannot import torch (apt-get install python3-torch)";
  }
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const auto ref = nlohmann::json::parse(std::ifstream(json_path));
  fs::remove_all(dir);

  constexpr int kWorld = 3, kRoot = 1;
  std::vector<std::map<std::string, std::vector<double>>> ours(kWorld);
  run_ranks(kWorld, [&](ProcessGroup& pg) {
    const int rank = pg.rank();
    auto& mine = ours[rank];
    auto keep = [&](const std::string& name, const at::Tensor& t) {
      at::Tensor d = t.to(torch::kDouble).reshape({-1}).contiguous();
      mine[name] = std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
    };
    for (auto [name, op] :
         {std::pair{"reduce_sum", ReduceOp::kSum}, std::pair{"reduce_max", ReduceOp::kMax},
          std::pair{"reduce_min", ReduceOp::kMin}}) {
      auto t = torch::arange(6, torch::kDouble) + 10 * rank;
      pg.reduce(t, kRoot, op).wait();
      if (rank == kRoot) keep(name, t);
    }
    {
      auto t = torch::tensor(
          {static_cast<int64_t>(rank), rank * int64_t{100}, -static_cast<int64_t>(rank)});
      std::vector<at::Tensor> outs;
      if (rank == kRoot) {
        for (int i = 0; i < kWorld; ++i) outs.push_back(torch::empty_like(t));
      }
      pg.gather(outs, t, kRoot).wait();
      if (rank == kRoot) keep("gather", torch::cat(outs));
    }
    {
      auto t = torch::empty({4});
      std::vector<at::Tensor> ins;
      if (rank == kRoot) {
        for (int j = 0; j < kWorld; ++j)
          ins.push_back(torch::arange(4, torch::kFloat) * (j + 1) + 0.5);
      }
      pg.scatter(t, ins, kRoot).wait();
      keep("scatter", t);
    }
    {
      auto t = torch::arange(kWorld * 2, torch::kFloat) + 100 * rank;
      auto o = torch::empty_like(t);
      pg.all_to_all_single(o, t).wait();
      keep("all_to_all_single", o);
    }
    {
      std::vector<int64_t> send, recv;
      std::vector<at::Tensor> chunks;
      for (int j = 0; j < kWorld; ++j) {
        send.push_back((rank + j) % kWorld);
        recv.push_back((j + rank) % kWorld);
        chunks.push_back(rank * 1000.0 + j * 100.0 +
                         torch::arange(send.back() * 2, torch::kDouble).view({send.back(), 2}));
      }
      auto t = torch::cat(chunks);
      auto o = torch::empty({recv[0] + recv[1] + recv[2], 2}, torch::kDouble);
      pg.all_to_all_single(o, t, recv, send).wait();
      keep("all_to_all_single_uneven", o);
    }
    {
      std::vector<at::Tensor> ins, outs;
      for (int j = 0; j < kWorld; ++j) {
        ins.push_back(rank * 1000 + j * 100 + torch::arange((rank + 1) * (j + 1), torch::kInt));
        outs.push_back(torch::empty({(j + 1) * (rank + 1)}, torch::kInt));
      }
      pg.all_to_all(outs, ins).wait();
      keep("all_to_all", torch::cat(outs));
    }
    {
      auto t = torch::arange(2, torch::kFloat) + rank;
      auto o = torch::empty({kWorld * 2});
      pg.all_gather_into_tensor(o, t).wait();
      keep("all_gather_into_tensor", o);
    }
    {
      auto t = torch::arange(kWorld * 2, torch::kFloat) + rank;
      auto o = torch::empty({2});
      pg.reduce_scatter_tensor(o, t).wait();
      keep("reduce_scatter_tensor", o);
    }
    {
      const int next = (rank + 1) % kWorld, prev = (rank + kWorld - 1) % kWorld;
      auto a = torch::arange(3, torch::kLong) + 10 * rank;
      auto b = torch::arange(2, torch::kDouble) * 0.5 + rank;
      std::vector<Work> sends = {pg.isend(a, next, 3), pg.isend(b, next, 5)};
      auto got_a = torch::empty({3}, torch::kLong), got_b = torch::empty({2}, torch::kDouble);
      Work rb = pg.irecv(got_b, prev, 5), ra = pg.irecv(got_a, prev, 3);
      rb.wait();
      ra.wait();
      for (Work& w : sends) w.wait();
      keep("send_recv", torch::cat({got_a.to(torch::kDouble), got_b}));
    }
  });

  // What PyTorch must have (its Gloo has these on 1.13 and 2.6): the check cannot pass empty.
  const std::set<std::string> required = {"reduce_sum",
                                          "reduce_max",
                                          "reduce_min",
                                          "gather",
                                          "scatter",
                                          "all_to_all_single",
                                          "all_to_all_single_uneven",
                                          "send_recv"};
  std::set<std::string> compared;
  for (int rank = 0; rank < kWorld; ++rank) {
    for (const auto& [name, value] : ref.at(std::to_string(rank)).items()) {
      if (value.is_string()) {
        EXPECT_EQ(required.count(name), 0u) << "python3-torch failed " << name << ": " << value;
        std::printf("[ python ] %s on rank %d: not in this PyTorch (%s)\n", name.c_str(), rank,
                    value.get<std::string>().c_str());
        continue;
      }
      ASSERT_TRUE(ours[rank].count(name))
          << name << " on rank " << rank << " has no result of ours";
      EXPECT_EQ(ours[rank][name], value.get<std::vector<double>>()) << name << " on rank " << rank;
      compared.insert(name);
    }
  }
  for (const auto& name : required)
    EXPECT_TRUE(compared.count(name)) << name << " was not compared";
  std::printf("[ python ] compared with PyTorch %zu collectives on 3 ranks\n", compared.size());
}

// Note [Backend pairs]: a backend per device type, written as PyTorch writes it
// ("cpu:gloo,cuda:nccl"). The Collectives suite runs over "cpu:shm,cuda:gloo" too
// (test_process_group_pair: every CPU tensor on the shm side, send and recv through its
// mailbox); here, how a pair is written and refused, and what it reduces to.
std::string formed_or_error(const std::string& backend) {
  InitOptions o = testing::one_rank_options();
  o.backend = backend;
  try {
    return make_process_group(o)->backend();
  } catch (const ConfigError& e) {
    return e.what();
  }
}

TEST(BackendPairs, WrittenAsPyTorchWritesThemAndRefusedNamingWhy) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"cpu:gloo,gpu:nccl",
       "backend 'cpu:gloo,gpu:nccl': 'gpu:nccl' names no device type; a backend per device is "
       "written 'cpu:NAME,cuda:NAME' (as PyTorch's 'cpu:gloo,cuda:nccl')"},
      {"cpu:gloo,cpu:shm", "backend 'cpu:gloo,cpu:shm': device 'cpu' is given twice"},
      {"cpu:", "backend 'cpu:': no backend named for 'cpu'"},
      {"cpu:nccl,cuda:gloo",
       "backend 'cpu:nccl,cuda:gloo': 'nccl' moves CUDA tensors; for 'cpu' choose 'shm', "
       "'gloo', 'shm+gloo', 'auto' or 'tuned'"},
      {"cpu:gloo,cuda:shm",
       "backend 'cpu:gloo,cuda:shm': CUDA tensors go over 'nccl' or 'gloo', "
       "not 'shm'"},
  };
  for (const auto& [backend, error] : refused) {
    EXPECT_EQ(formed_or_error(backend), error) << backend;
  }
#if !DDP_WITH_NCCL
  EXPECT_NE(formed_or_error("cpu:gloo,cuda:nccl").find("backend 'nccl' is not available"),
            std::string::npos);
#endif
  // One side named, or Gloo on both (one Gloo group takes both): one backend.
  EXPECT_EQ(formed_or_error("cpu:gloo"), "gloo");
  EXPECT_EQ(formed_or_error("cuda:gloo"), "gloo");
  EXPECT_EQ(formed_or_error("cpu:gloo,cuda:gloo"), "gloo");
  // Either order; "auto" on the CPU side is the CPU's choice (shm on one host).
  EXPECT_EQ(formed_or_error("cuda:gloo,cpu:auto"), "cpu:shm,cuda:gloo");
}

// A pair over shm and Gloo at world 2: CPU tensors take the shm side, comm buffers are shm's
// (reduced in place), a subgroup inherits the pair, and a call mixing devices is refused before
// it takes a number (no CUDA here: a meta tensor stands for the other device's).
TEST(BackendPairs, CpuTensorsTakeTheCpuSide) {
  const int port = testing::free_port();
  auto errors = testing::run_threads(2, [&](int r) {
    detail::TestingOptions o = testing::thread_rank(r, 2, port);
    o.backend = "cpu:shm,cuda:gloo";
    o.host_id.reset();  // one host, whatever DDP_TEST_HOSTS lays out
    auto pg = make_process_group(o);
    EXPECT_EQ(pg->backend(), "cpu:shm,cuda:gloo");
    EXPECT_TRUE(capabilities_of(*pg).cpu_tensors && capabilities_of(*pg).cuda_tensors);
    at::Tensor buf = pg->comm_buffer(6, torch::kFloat);
    EXPECT_TRUE(pg->is_comm_buffer(buf));
    buf.fill_(static_cast<float>(r + 1));
    pg->all_reduce(buf).wait();
    EXPECT_TRUE(torch::equal(buf, torch::full({6}, 3.0f))) << buf;
    auto sub = pg->new_group({0, 1});
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->backend(), "cpu:shm,cuda:gloo");
    auto t = torch::full({2}, static_cast<float>(r));
    sub->all_reduce(t).wait();
    EXPECT_TRUE(torch::equal(t, torch::ones({2}))) << t;
    std::vector<at::Tensor> mixed{torch::empty({2}), torch::empty({2}, torch::kMeta)};
    const uint64_t before = pg->last_sequence_number();
    try {
      pg->all_gather(mixed, torch::ones({2})).wait();
      ADD_FAILURE() << "a call mixing devices was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("with the backend pair 'cpu:shm,cuda:gloo' a "
                                           "collective's tensors must all be on one device type"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(pg->last_sequence_number(), before);
    sub->barrier().wait();
    pg->barrier().wait();
  });
  for (int r = 0; r < 2; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << testing::message_of(errors[r]);
  }
}

// Subgroups (Note [Subgroups]): collectives among their members only, numbered on their own,
// over the transport the members' locality allows; the parent goes on beside them.
TEST(Subgroups, NewGroupAndSplitGroupReduceAmongTheirMembersOnly) {
  run_ranks(4, [](ProcessGroup& pg) {
    const int me = pg.rank();
    auto odd = pg.new_group({3, 1});
    ASSERT_EQ(odd != nullptr, me % 2 == 1) << "rank " << me;
    if (odd) {
      EXPECT_EQ(odd->size(), 2);
      EXPECT_EQ(odd->rank(), me / 2);  // 1 -> 0, 3 -> 1: sorted, as PyTorch's
      auto t = torch::full({3}, static_cast<float>(me));
      odd->all_reduce(t).wait();
      EXPECT_TRUE(torch::equal(t, torch::full({3}, 4.0f))) << t;
      EXPECT_EQ(odd->last_sequence_number(), 1u);
    }
    auto pair = pg.split_group({{0, 1}, {2, 3}});
    ASSERT_NE(pair, nullptr);
    EXPECT_EQ(pair->size(), 2);
    EXPECT_EQ(pair->rank(), me % 2);
    auto t = torch::full({2}, static_cast<float>(me));
    pair->all_reduce(t).wait();
    EXPECT_TRUE(torch::equal(t, torch::full({2}, me < 2 ? 1.0f : 5.0f))) << t;
    std::vector<at::Tensor> got{torch::empty({1}, torch::kInt), torch::empty({1}, torch::kInt)};
    pair->all_gather(got, torch::full({1}, me, torch::kInt)).wait();
    EXPECT_EQ(got[0].item<int>(), me - me % 2);
    EXPECT_EQ(got[1].item<int>(), me - me % 2 + 1);
    if (testing::test_hosts() == 2) {
      // Hosts laid out 2 + 2: each pair is one host's (shared memory); the odd ranks are one
      // on each host (Gloo).
      EXPECT_EQ(pair->backend(), "shm");
      if (odd) EXPECT_EQ(odd->backend(), "gloo");
    } else {
      EXPECT_EQ(pair->backend(), testing::test_backend());
    }
    auto all = pg.new_group();
    ASSERT_NE(all, nullptr);
    EXPECT_EQ(all->size(), 4);
    EXPECT_EQ(all->rank(), me);
    auto ones = torch::ones({1});
    all->all_reduce(ones).wait();
    EXPECT_EQ(ones.item<float>(), 4.0f);
    // The parent's numbering is its own.
    const uint64_t before = pg.last_sequence_number();
    auto p = torch::ones({1});
    pg.all_reduce(p).wait();
    EXPECT_EQ(p.item<float>(), 4.0f);
    EXPECT_EQ(pg.last_sequence_number(), before + 1);
    pair->barrier().wait();
    if (odd) odd->barrier().wait();
    all->barrier().wait();
  });
}

TEST(Subgroups, BadRanksAreNamedAndTakeNoNumber) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto expect_error = [](const std::function<void()>& call, const std::string& text) {
      try {
        call();
        ADD_FAILURE() << "no error; expected: " << text;
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
      }
    };
    expect_error(
        [&] {
          pg.new_group({0, 2});
        },
        "new_group: rank 2 is not in this group of 2 ranks");
    expect_error([&] { pg.new_group({1, 1}); }, "new_group: rank 1 is listed twice");
    expect_error(
        [&] {
          pg.split_group({{0, 1}, {1}});
        },
        "split_group: rank 1 is in list 0 and in list 1; the lists must not overlap");
    auto g = pg.new_group({0, 1});
    ASSERT_NE(g, nullptr);
    auto t = torch::ones({1});
    g->all_reduce(t).wait();
    EXPECT_EQ(t.item<float>(), 2.0f);
    g->barrier().wait();
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
  // The rest, at world size 1 (their values at larger sizes: Collectives above).
  auto r = torch::full({2}, 3.0f);
  reduce(r, 0, ReduceOp::kMax);
  EXPECT_TRUE(torch::equal(r, torch::full({2}, 3.0f)));
  gather(out, r, 0);
  EXPECT_TRUE(torch::equal(out[0], r));
  auto s = torch::empty({2});
  scatter(s, {r}, 0);
  reduce_scatter(s, {r});
  all_to_all_single(s, r);
  EXPECT_TRUE(torch::equal(s, r));
  std::vector<at::Tensor> outs{torch::empty({2})};
  all_to_all(outs, {r});
  auto into = torch::empty({2});
  all_gather_into_tensor(into, r);
  reduce_scatter_tensor(s, into);
  EXPECT_TRUE(torch::equal(outs[0], r) && torch::equal(into, r) && torch::equal(s, r));
  destroy_process_group();
  EXPECT_FALSE(is_initialized());
  EXPECT_THROW(default_group(), Error);
}

}  // namespace
}  // namespace ddp
