// The shared-memory transport with ranks as threads: every collective and dtype at world sizes
// 1-4, sizes of one element to many chunks (ctest sets DDP_SHM_CHUNK_BYTES=4096), results
// bit-identical across ranks and equal to Gloo's, and the failures it must name: a timeout, a
// desync, a rank that left, an error that poisons the group. Comm buffers (memory every rank
// maps, reduced in place): every dtype and op at any offset, mixed placements, bit-identity,
// sizes that differ between ranks, and no mapping left once the tensors are gone.
#include <unistd.h>  // getpid

#include <atomic>
#include <fstream>
#include <latch>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/error.h"
#include "process_group/shm/group.h"  // the transport alone
#include "support/ranks.h"

namespace ddp {
namespace {

using namespace std::chrono_literals;
using testing::message_of;
using testing::run_threads;
using testing::thread_rank;

InitOptions shm_rank(int rank, int world, int port, std::chrono::milliseconds timeout = 60s) {
  auto o = thread_rank(rank, world, port, timeout);
  o.backend = "shm";
  return o;
}

// Runs fn(pg) on `world` thread-ranks of one shm group; any exception fails the test.
void run_shm(int world, const std::function<void(ProcessGroup&)>& fn) {
  const int port = testing::free_port();
  auto errors = run_threads(world, [&](int r) {
    auto pg = make_process_group(shm_rank(r, world, port));
    ASSERT_EQ(pg->backend(), "shm");
    fn(*pg);
    pg->barrier().wait();
  });
  for (int r = 0; r < world; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << message_of(errors[r]);
  }
}

void expect_contains(const std::string& message, std::initializer_list<const char*> needles) {
  for (const char* n : needles) {
    EXPECT_NE(message.find(n), std::string::npos) << "'" << n << "' not in: " << message;
  }
}

// Element counts: tiny, odd, not divisible by any world size, and many 4 KiB chunks long.
const std::vector<int64_t> kSizes = {1, 7, 1000, 12345};

class ShmCollectives : public ::testing::TestWithParam<int> {};

// Small integers are exact in every dtype, so every reduction has one right answer.
TEST_P(ShmCollectives, AllReduceEveryDtypeOpAndSize) {
  const int n = GetParam();
  run_shm(n, [n](ProcessGroup& pg) {
    const int r = pg.rank();
    for (auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf, torch::kInt,
                       torch::kLong, torch::kByte}) {
      for (int64_t size : kSizes) {
        // element i on rank r: (i % 7) + r
        auto make = [&] { return (torch::arange(size) % 7 + r).to(dtype); };
        const auto base = torch::arange(size) % 7;
        auto t = make();
        pg.all_reduce(t, ReduceOp::kSum).wait();
        EXPECT_TRUE(torch::equal(t, (base * n + n * (n - 1) / 2).to(dtype)))
            << c10::toString(dtype) << " x " << size;
        t = make();
        pg.all_reduce(t, ReduceOp::kMax).wait();
        EXPECT_TRUE(torch::equal(t, (base + (n - 1)).to(dtype))) << c10::toString(dtype);
        t = make();
        pg.all_reduce(t, ReduceOp::kMin).wait();
        EXPECT_TRUE(torch::equal(t, base.to(dtype))) << c10::toString(dtype);
        if (at::isFloatingType(dtype)) {
          t = make();
          pg.all_reduce(t, ReduceOp::kAvg).wait();
          const auto want = (base.to(torch::kDouble) + (n - 1) / 2.0).to(dtype);
          EXPECT_TRUE(torch::allclose(t.to(torch::kDouble), want.to(torch::kDouble)))
              << c10::toString(dtype);
        }
      }
    }
  });
}

TEST_P(ShmCollectives, BroadcastAllGatherReduceScatterEverySize) {
  const int n = GetParam();
  run_shm(n, [n](ProcessGroup& pg) {
    const int r = pg.rank();
    for (int64_t size : kSizes) {
      for (int root = 0; root < n; ++root) {
        auto t = torch::full({size}, r * 1000 + 0.5, torch::kDouble);
        pg.broadcast(t, root).wait();
        EXPECT_TRUE(torch::equal(t, torch::full({size}, root * 1000 + 0.5, torch::kDouble)));
      }
      auto in = torch::arange(size, torch::kLong) + r * 100000;
      std::vector<at::Tensor> out(n);
      for (auto& o : out) o = torch::empty_like(in);
      pg.all_gather(out, in).wait();
      for (int p = 0; p < n; ++p) {
        EXPECT_TRUE(torch::equal(out[p], torch::arange(size, torch::kLong) + p * 100000)) << p;
      }
      // inputs[j] on rank r: r + 10 j, so output j = sum_r r + 10 j n.
      std::vector<at::Tensor> inputs;
      for (int j = 0; j < n; ++j) inputs.push_back(torch::full({size}, float(r + 10 * j)));
      auto rs = torch::empty({size});
      pg.reduce_scatter(rs, inputs, ReduceOp::kSum).wait();
      EXPECT_TRUE(torch::equal(rs, torch::full({size}, n * (n - 1) / 2.0f + 10.0f * r * n)));
    }
  });
}

TEST_P(ShmCollectives, NonContiguousTensorsAreReducedInPlace) {
  const int n = GetParam();
  run_shm(n, [n](ProcessGroup& pg) {
    auto m = torch::full({6, 4}, static_cast<float>(pg.rank() + 1));
    auto col = m.select(1, 2);  // stride 4
    ASSERT_FALSE(col.is_contiguous());
    pg.all_reduce(col).wait();
    EXPECT_TRUE(torch::equal(col, torch::full({6}, n * (n + 1) / 2.0f)));
    EXPECT_TRUE(torch::equal(m.select(1, 0), torch::full({6}, pg.rank() + 1.0f)));
  });
}

// Every slice is summed by one rank in rank order: all replicas hold the same bits, even at 3
// ranks where float addition order matters; and the result is Gloo's within rounding.
TEST_P(ShmCollectives, ReplicasAreBitIdenticalAndMatchGloo) {
  const int n = GetParam();
  const int port = testing::free_port();
  const int gloo_port = testing::free_port();
  std::vector<at::Tensor> results(n);
  auto errors = run_threads(n, [&](int r) {
    auto shm = make_process_group(shm_rank(r, n, port));
    auto go = thread_rank(r, n, gloo_port);
    go.backend = "gloo";
    go.group_name = "gloo";
    auto gloo = make_process_group(go);
    torch::manual_seed(1234 + r);
    auto a = torch::randn({12345}) * 1000;
    auto b = a.clone();
    shm->all_reduce(a, ReduceOp::kAvg).wait();
    gloo->all_reduce(b, ReduceOp::kAvg).wait();
    EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-3)) << (a - b).abs().max();
    results[r] = a;
    shm->barrier().wait();
    gloo->barrier().wait();
  });
  for (int r = 0; r < n; ++r) ASSERT_FALSE(errors[r]) << message_of(errors[r]);
  for (int r = 1; r < n; ++r) EXPECT_TRUE(torch::equal(results[0], results[r])) << r;
}

TEST_P(ShmCollectives, ManyInFlightWaitedInReverse) {
  const int n = GetParam();
  run_shm(n, [n](ProcessGroup& pg) {
    std::vector<at::Tensor> ts;
    std::vector<Work> works;
    for (int i = 0; i < 12; ++i) {
      ts.push_back(torch::full({3000 + i}, static_cast<float>(i + pg.rank())));
      works.push_back(pg.all_reduce(ts.back()));
    }
    for (int i = 11; i >= 0; --i) {
      works[i].wait();
      EXPECT_TRUE(torch::equal(ts[i], torch::full({3000 + i}, float(i * n + n * (n - 1) / 2))));
    }
  });
}

// Tensors inside comm buffers are reduced in place (no staging): the whole buffer and parts of
// it at odd offsets, every dtype and op, sizes that split unevenly over the ranks.
TEST_P(ShmCollectives, CommBufferAllReduceEveryDtypeOpAndOffset) {
  const int n = GetParam();
  run_shm(n, [n](ProcessGroup& pg) {
    const int r = pg.rank();
    for (auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf, torch::kInt,
                       torch::kLong, torch::kByte}) {
      at::Tensor buffer = pg.comm_buffer(2 * 12345 + 3, torch::TensorOptions().dtype(dtype));
      ASSERT_EQ(buffer.scalar_type(), dtype);
      EXPECT_TRUE(torch::equal(buffer, torch::zeros_like(buffer)));  // zeroed
      for (int64_t size : kSizes) {
        for (int64_t offset : {int64_t{0}, int64_t{3}, int64_t{12345}}) {
          at::Tensor t = buffer.narrow(0, offset, size);
          const auto base = torch::arange(size) % 7;
          for (auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kAvg}) {
            if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
            t.copy_((base + r).to(dtype));
            pg.all_reduce(t, op).wait();
            at::Tensor want = op == ReduceOp::kSum   ? base * n + n * (n - 1) / 2
                              : op == ReduceOp::kMax ? base + (n - 1)
                              : op == ReduceOp::kMin ? base
                                                     : base.to(torch::kDouble) + (n - 1) / 2.0;
            EXPECT_TRUE(torch::allclose(t.to(torch::kDouble), want.to(dtype).to(torch::kDouble)))
                << c10::toString(dtype) << " x " << size << " at " << offset << " op "
                << to_string(op);
          }
        }
      }
    }
  });
}

// Float sums whose order matters: the in-place path sums each slice once, in rank order, so
// every replica holds the same bits; and it agrees with the staged path within rounding.
TEST_P(ShmCollectives, CommBufferReplicasAreBitIdentical) {
  const int n = GetParam();
  std::vector<at::Tensor> results(n);
  run_shm(n, [&](ProcessGroup& pg) {
    torch::manual_seed(99 + pg.rank());
    at::Tensor values = torch::randn({50001}) * 1000;
    at::Tensor in_place = pg.comm_buffer(values.numel(), torch::kFloat);
    in_place.copy_(values);
    at::Tensor staged = values.clone();
    pg.all_reduce(in_place, ReduceOp::kSum).wait();
    pg.all_reduce(staged, ReduceOp::kSum).wait();
    EXPECT_TRUE(torch::allclose(in_place, staged, 1e-5, 1e-3));
    results[pg.rank()] = in_place.clone();
  });
  for (int r = 1; r < n; ++r) EXPECT_TRUE(torch::equal(results[0], results[r])) << r;
}

// One rank's tensor in a comm buffer, another's in ordinary memory, a third's in the buffer at
// another offset: every rank falls back to staging together, and the result is right.
TEST_P(ShmCollectives, CommBufferMixedPlacementsFallBackTogether) {
  const int n = GetParam();
  run_shm(n, [n](ProcessGroup& pg) {
    const int r = pg.rank();
    at::Tensor buffer = pg.comm_buffer(30000, torch::kFloat);
    for (int64_t size : kSizes) {
      at::Tensor t = r % 2 == 1 ? torch::empty({size}) : buffer.narrow(0, r == 2 ? 17 : 0, size);
      t.fill_(static_cast<float>(r + 1));
      pg.all_reduce(t).wait();
      EXPECT_TRUE(torch::equal(t, torch::full({size}, n * (n + 1) / 2.0f))) << size;
      at::Tensor whole = buffer.narrow(0, 0, size);  // then in place again, on every rank
      whole.fill_(1.0f);
      pg.all_reduce(whole).wait();
      EXPECT_TRUE(torch::equal(whole, torch::full({size}, static_cast<float>(n))));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmCollectives, ::testing::Values(1, 2, 3, 4));

// Mappings of comm buffers named "ddp-shm-...-buffer-..." in this process.
int buffer_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int count = 0;
  while (std::getline(maps, line)) count += line.find("-buffer-") != std::string::npos;
  return count;
}

TEST(ShmCommBuffers, EveryRankMapsEveryPartAndNothingOutlivesTheTensors) {
  const int before = buffer_mappings();
  const int port = testing::free_port();
  std::latch allocated(3), checked(3);
  int during = 0;
  auto errors = run_threads(3, [&](int r) {
    auto pg = make_process_group(shm_rank(r, 3, port));
    at::Tensor b = pg->comm_buffer(1 << 20, torch::kFloat);
    allocated.arrive_and_wait();
    if (r == 0) during = buffer_mappings();
    checked.arrive_and_wait();
    b.fill_(1.0f);
    pg->all_reduce(b).wait();
    EXPECT_TRUE(torch::equal(b, torch::full({1 << 20}, 3.0f)));
    pg->barrier().wait();
  });
  for (int r = 0; r < 3; ++r) ASSERT_FALSE(errors[r]) << message_of(errors[r]);
  EXPECT_EQ(during - before, 9);  // 3 thread-ranks x 3 parts, all in this process
  EXPECT_EQ(buffer_mappings(), before);
}

TEST(ShmCommBuffers, SizesThatDifferBetweenRanksAreNamed) {
  const int port = testing::free_port();
  std::vector<std::string> messages(2);
  auto errors = run_threads(2, [&](int r) {
    auto pg = make_process_group(shm_rank(r, 2, port));
    try {
      pg->comm_buffer(r == 0 ? 100 : 200, torch::kFloat);
    } catch (const Error& e) {
      messages[r] = e.what();
    }
  });
  expect_contains(messages[0], {"[rank 0] comm buffer #1: this rank asked for 400 bytes, rank 1 "
                                "for 800",
                                "collective"});
  expect_contains(messages[1], {"[rank 1]", "rank 0 for 400"});
}

TEST(ShmCommBuffers, OtherBackendsAndOneRankGiveOrdinaryMemory) {
  auto one = testing::one_rank_group();
  at::Tensor t = one->comm_buffer(5, torch::kDouble);
  EXPECT_TRUE(torch::equal(t, torch::zeros({5}, torch::kDouble)));
  one->all_reduce(t).wait();
  const int port = testing::free_port();
  auto errors = run_threads(2, [&](int r) {
    auto o = thread_rank(r, 2, port);
    o.backend = "gloo";
    auto pg = make_process_group(o);
    at::Tensor b = pg->comm_buffer(1000, torch::kFloat);
    b.fill_(2.0f);
    pg->all_reduce(b).wait();
    EXPECT_TRUE(torch::equal(b, torch::full({1000}, 4.0f)));
  });
  for (int r = 0; r < 2; ++r) ASSERT_FALSE(errors[r]) << message_of(errors[r]);
  EXPECT_EQ(buffer_mappings(), 0);
}

TEST(ShmErrors, TimeoutNamesTheOpAndTheRankBehind) {
  const int port = testing::free_port();
  std::string message;
  double waited_s = 0;
  std::latch rank0_done(1);
  auto errors = run_threads(2, [&](int r) {
    auto pg = make_process_group(shm_rank(r, 2, port, /*timeout=*/1s));
    if (r == 0) {
      auto t = torch::ones({4});
      const auto start = std::chrono::steady_clock::now();
      try {
        pg->all_reduce(t).wait();
      } catch (const TimeoutError& e) {
        message = e.what();
      }
      waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    if (r == 1) rank0_done.wait();  // never joins the all_reduce; leaves after rank 0 gave up
    if (r == 0) rank0_done.count_down();
  });
  EXPECT_FALSE(errors[0]) << message_of(errors[0]);
  EXPECT_GE(waited_s, 0.9);
  EXPECT_LT(waited_s, 3.0);
  expect_contains(message, {"[rank 0] all_reduce #1 (sum, 4 x Float) timed out",
                            "rank 1 has not issued any collective", "DDP_COLLECTIVE_TIMEOUT"});
}

// The transport alone, two thread-ranks over one segment: a composed op whose deadline was
// restarted (as the hierarchy does after its cross-host step) times out later than the limit
// after it started, and the message says how long it really waited.
TEST(ShmErrors, ATimeoutAfterARestartedDeadlineReportsTheTimeSinceTheOpStarted) {
  constexpr size_t kChunk = 4096;
  const size_t bytes = shm::Group::segment_bytes(2, kChunk);
  shm::Segment segments[2];
  segments[0] = shm::Segment::create("ddp-test-shm", bytes);
  segments[1] = shm::Segment::open(getpid(), segments[0].fd(), bytes);
  std::string message;
  std::latch rank0_done(1);
  auto errors = run_threads(2, [&](int r) {
    struct CountDown {  // rank 1 leaves only after rank 0, whatever happens to rank 0
      std::latch* latch;
      ~CountDown() {
        if (latch != nullptr) latch->count_down();
      }
    } done{r == 0 ? &rank0_done : nullptr};
    shm::Group group(shm::Options{r, 2, 1000ms, kChunk, {}}, std::move(segments[r]));
    if (r == 1) {
      rank0_done.wait();  // never joins the op
      return;
    }
    int64_t value = 0;
    auto op = group.run(1, CollectiveDesc{}, [&] {
      std::this_thread::sleep_for(700ms);  // a step that waited elsewhere
      group.restart_deadline();
      group.broadcast_here(&value, sizeof value, 0);
    });
    try {
      group.wait(*op);
    } catch (const TimeoutError& e) {
      message = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) ASSERT_FALSE(errors[r]) << message_of(errors[r]);
  const std::string after = "timed out after ";
  const size_t at = message.find(after);
  ASSERT_NE(at, std::string::npos) << message;
  const double elapsed = std::stod(message.substr(at + after.size()));
  EXPECT_GE(elapsed, 1.6) << message;
  EXPECT_LT(elapsed, 3.0) << message;
  expect_contains(message, {"(limit 1.0 s"});
}

// The layout word at a segment's start (group.cpp): "DDPSHM" in the high 48 bits, the layout
// version in the low 16; written by local rank 0, checked by the others.
constexpr uint64_t kSegmentMark = 0x4444'5053'484d'0000;

// A peer that maps the segment of a build with another layout refuses it, naming both versions,
// instead of reading slots that are not where it thinks.
TEST(ShmErrors, ASegmentOfAnotherLayoutIsRefusedNamingBothVersions) {
  constexpr size_t kChunk = 4096;
  const size_t bytes = shm::Group::segment_bytes(2, kChunk);
  for (const uint64_t word : {kSegmentMark | 0xfffe, uint64_t{0x1234}}) {
    shm::Segment created = shm::Segment::create("ddp-test-shm", bytes);
    reinterpret_cast<std::atomic<uint64_t>*>(created.data())->store(word);
    std::string message;
    try {
      shm::Group group(shm::Options{1, 2, 1000ms, kChunk, {}},
                       shm::Segment::open(getpid(), created.fd(), bytes));
    } catch (const Error& e) {
      message = e.what();
    }
    if (word == uint64_t{0x1234}) {
      expect_contains(message, {"[rank 1] the shared-memory segment of rank 0 is not a ddp-cpp "
                                "segment (its first word is 0x1234)",
                                "every rank must run the same ddp-cpp build"});
    } else {
      expect_contains(message, {"[rank 1] the shared-memory segment of rank 0 has layout version "
                                "65534, this build expects ",
                                ": every rank must run the same ddp-cpp build"});
    }
  }
}

TEST(ShmErrors, DesyncIsNamedAtOnceOnEveryRank) {
  const int port = testing::free_port();
  std::vector<std::string> messages(2);
  std::vector<double> waited(2);
  std::latch both_failed(2);
  auto errors = run_threads(2, [&](int r) {
    auto pg = make_process_group(shm_rank(r, 2, port, /*timeout=*/30s));
    auto f = torch::ones({4});
    pg->all_reduce(f).wait();  // #1 agrees
    const auto start = std::chrono::steady_clock::now();
    try {
      if (r == 0) {
        pg->all_reduce(f).wait();
      } else {
        auto l = torch::ones({3}, torch::kLong);
        pg->broadcast(l, 0).wait();
      }
    } catch (const CollectiveError& e) {
      messages[r] = e.what();
    }
    waited[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Rank 0 hosts the store: it stays until rank 1's hang report is done with it. Otherwise
    // rank 1, a moment behind, finds the store gone and its report's store calls take their
    // bound (seen as a 3.3 s wait, about 1 run in 10).
    both_failed.arrive_and_wait();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(errors[r]) << message_of(errors[r]);
    EXPECT_LT(waited[r], 2.0);
    expect_contains(messages[r],
                    {"collectives differ between ranks", "all_reduce #2 (sum, 4 x Float)",
                     "broadcast #2 (from rank 0, 3 x Long)"});
  }
  expect_contains(messages[0], {"[rank 0]", "rank 1 issued broadcast #2"});
  expect_contains(messages[1], {"[rank 1]", "rank 0 issued all_reduce #2"});
}

TEST(ShmErrors, RankThatLeftFailsPeersFastAndTheGroupStaysFailed) {
  const int port = testing::free_port();
  std::string first, second;
  std::vector<double> waited_s(3);  // per rank: ranks 0 and 1 both measure
  std::latch rank2_gone(1);
  auto errors = run_threads(3, [&](int r) {
    auto pg = make_process_group(shm_rank(r, 3, port, /*timeout=*/60s));
    if (r == 2) {
      pg.reset();
      rank2_gone.count_down();
      return;
    }
    rank2_gone.wait();
    auto t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->all_reduce(t).wait();
    } catch (const CollectiveError& e) {
      if (r == 0) first = e.what();
    }
    waited_s[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    try {
      pg->barrier().wait();
    } catch (const CollectiveError& e) {
      if (r == 0) second = e.what();
    }
  });
  ASSERT_FALSE(errors[0]) << message_of(errors[0]);
  EXPECT_LT(std::max(waited_s[0], waited_s[1]), 5.0);
  // Rank 0 either saw rank 2 leave itself, or rank 1 did first and told it.
  expect_contains(first, {"[rank 0] all_reduce #1 (sum, 4 x Float) failed", "rank 2"});
  expect_contains(second, {"[rank 0] barrier #2 was not run", "failed at an earlier collective"});
}

TEST(ShmSelection, RanksAskingForDifferentBackendsFailTogetherNamingBoth) {
  const int port = testing::free_port();
  std::vector<std::string> messages(2);
  auto errors = run_threads(2, [&](int r) {
    InitOptions o = shm_rank(r, 2, port);
    if (r == 1) o.backend = "gloo";
    try {
      make_process_group(o);
    } catch (const ConfigError& e) {
      messages[r] = e.what();
    }
  });
  expect_contains(messages[0], {"[rank 0] ranks ask for different backends: this rank 'shm', "
                                "rank 1 'gloo'",
                                "DDP_BACKEND"});
  expect_contains(messages[1], {"[rank 1]", "this rank 'gloo', rank 0 'shm'"});
}

TEST(ShmSelection, AutoPicksShmOnOneHostAndTheEnvironmentChooses) {
  InitOptions o = testing::one_rank_options();
  EXPECT_EQ(make_process_group(o)->backend(), "shm");
  setenv("DDP_BACKEND", "gloo", 1);
  EXPECT_EQ(make_process_group(o)->backend(), "gloo");
  o.backend = "shm";  // options win over the environment
  EXPECT_EQ(make_process_group(o)->backend(), "shm");
  unsetenv("DDP_BACKEND");
  setenv("DDP_SHM_CHUNK_BYTES", "100", 1);
  EXPECT_THROW(make_process_group(o), ConfigError);
  unsetenv("DDP_SHM_CHUNK_BYTES");
  auto pg = make_process_group(o);
  auto cuda_like = torch::ones({2});
  std::vector<at::Tensor> out{torch::empty({2})};
  pg->all_gather(out, cuda_like).wait();
  EXPECT_TRUE(torch::equal(out[0], cuda_like));
}

}  // namespace
}  // namespace ddp
