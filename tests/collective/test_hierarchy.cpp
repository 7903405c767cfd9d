// The hierarchical transport (Note [Hierarchical collectives] in
// src/process_group/transport/hierarchy.cpp)
// with thread-ranks laid out as hosts through TestingOptions::host_id: which layouts choose it,
// every collective's result, bit-identical replicas, comm buffers, and a rank that leaves.
#include <latch>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "ddp/comm_hooks.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/error.h"
#include "process_group/internal.h"
#include "support/ranks.h"

namespace ddp {
namespace {

using namespace std::chrono_literals;
using testing::message_of;
using testing::run_threads;
using testing::thread_rank;

constexpr uint64_t kNever = RouteTuning::kNever;

// `hosts[r]` names rank r's host. "shm+gloo": the hierarchy, its route not measured.
detail::TestingOptions on_host(int rank, const std::vector<std::string>& hosts, int port,
                               std::chrono::milliseconds timeout = 60s,
                               std::string backend = "shm+gloo") {
  auto o = thread_rank(rank, static_cast<int>(hosts.size()), port, timeout);
  o.backend = std::move(backend);
  o.host_id = hosts[rank];
  return o;
}

// fn on every rank of a group laid out on `hosts`; all_reduces of `flat_from` bytes and more
// take flat Gloo (Note [Choosing the all_reduce route]).
void run_on_hosts(const std::vector<std::string>& hosts,
                  const std::function<void(ProcessGroup&)>& fn, uint64_t flat_from = kNever,
                  const std::string& backend = "shm+gloo") {
  const int port = testing::free_port();
  const int n = static_cast<int>(hosts.size());
  auto errors = run_threads(n, [&](int r) {
    auto pg = make_process_group(on_host(r, hosts, port, 60s, backend));
    if (flat_from != kNever) {
      detail::impl_of(*pg).transport->route_tuning()->set_flat_route_from(flat_from);
    }
    fn(*pg);
    pg->barrier().wait();
  });
  for (int r = 0; r < n; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << message_of(errors[r]);
  }
}

std::string backend_for(const std::vector<std::string>& hosts,
                        const std::string& backend = "auto") {
  std::vector<std::string> got(hosts.size());
  run_on_hosts(
      hosts, [&](ProcessGroup& pg) { got[pg.rank()] = pg.backend(); }, kNever, backend);
  for (const auto& b : got) EXPECT_EQ(b, got[0]);
  return got[0];
}

const std::vector<std::string> kTwoByTwo = {"a", "a", "b", "b"};
const std::vector<std::string> kThreeByTwo = {"a", "a", "b", "b", "c", "c"};

TEST(Hierarchy, ChosenForEqualHostsWithSeveralRanksElseGloo) {
  EXPECT_EQ(backend_for(kTwoByTwo), "shm+gloo");
  EXPECT_EQ(backend_for({"a", "b", "a", "b"}), "shm+gloo");  // hosts need not be contiguous
  EXPECT_EQ(backend_for({"a", "a", "b"}), "gloo");           // unequal hosts
  EXPECT_EQ(backend_for({"a", "b"}), "gloo");                // one rank per host
  EXPECT_EQ(backend_for({"a", "a"}), "shm");                 // one host
}

// Asked for by name, the hierarchy forms where it can (one host: shm), and is an error on every
// rank where it cannot.
TEST(Hierarchy, ExplicitShmPlusGlooNeedsEqualHostsWithSeveralRanks) {
  EXPECT_EQ(backend_for(kTwoByTwo, "shm+gloo"), "shm+gloo");
  EXPECT_EQ(backend_for({"a", "a"}, "shm+gloo"), "shm");
  for (const auto& hosts : std::vector<std::vector<std::string>>{{"a", "a", "b"}, {"a", "b"}}) {
    const int n = static_cast<int>(hosts.size());
    const int port = testing::free_port();
    std::vector<std::string> messages(n);
    auto errors = run_threads(n, [&](int r) {
      try {
        make_process_group(on_host(r, hosts, port));
      } catch (const RendezvousError& e) {
        messages[r] = e.what();
      }
    });
    const std::string layout = n == 3 ? "2 hosts with 2/1 ranks" : "2 hosts with 1/1 ranks";
    for (int r = 0; r < n; ++r) {
      EXPECT_FALSE(errors[r]) << message_of(errors[r]);
      EXPECT_NE(messages[r].find(fmt::format("[rank {}] backend 'shm+gloo' cannot be used: {}; it "
                                             "needs the same number of ranks, more than one, on "
                                             "every host. Use backend 'auto' or 'gloo'.",
                                             r, layout)),
                std::string::npos)
          << messages[r];
    }
  }
}

// Note [Choosing the all_reduce route]: backend tuned measures both routes as the group forms,
// in numbered collectives, and every rank takes the same choice; auto and shm+gloo measure
// nothing (the route, hence the summation order, is the same in every run).
TEST(Hierarchy, TunedMeasuresItsAllReduceRouteAndEveryRankChoosesTheSame) {
  for (const std::string backend : {"tuned", "auto", "shm+gloo"}) {
    std::vector<uint64_t> from(4), issued(4);
    std::vector<std::string> first(4);
    run_on_hosts(
        kTwoByTwo,
        [&](ProcessGroup& pg) {
          ASSERT_EQ(pg.backend(), "shm+gloo");
          from[pg.rank()] = detail::impl_of(pg).transport->route_tuning()->flat_route_from();
          issued[pg.rank()] = pg.last_sequence_number();
          const auto records = detail::impl_of(pg).recorder->snapshot();
          if (!records.empty()) first[pg.rank()] = records.front().call.describe();
          // The group works either way: a user's first collective follows the measurement.
          auto t = torch::full({1 << 19}, float(pg.rank()));
          pg.all_reduce(t).wait();
          EXPECT_TRUE(torch::equal(t, torch::full({1 << 19}, 6.0f)));
        },
        kNever, backend);
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(from[r], from[0]) << backend << " rank " << r;
      EXPECT_EQ(issued[r], issued[0]) << backend << " rank " << r;
    }
    if (backend == "tuned") {
      // 256 KiB at least: 8 timed or warm-up all_reduces and the agreement, per size measured.
      EXPECT_GE(issued[0], 9u);
      EXPECT_EQ(issued[0] % 9, 0u);
      EXPECT_EQ(first[0], "all_reduce #1 (sum, 65536 x Float)");
    } else {
      EXPECT_EQ(issued[0], 0u);
      EXPECT_EQ(from[0], kNever);
    }
  }
}

TEST(Hierarchy, ExplicitShmAcrossHostsIsAnErrorOnEveryRank) {
  const int port = testing::free_port();
  std::vector<std::string> messages(2);
  auto errors = run_threads(2, [&](int r) {
    auto o = on_host(r, {"a", "b"}, port);
    o.backend = "shm";
    try {
      make_process_group(o);
    } catch (const RendezvousError& e) {
      messages[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(messages[r].find("backend 'shm' cannot be used: ranks 0 and 1 are on different "
                               "hosts"),
              std::string::npos)
        << messages[r];
  }
}

// Capabilities are declared by each transport, typed (Note [Transports]), not derived from the
// backend's name: the hierarchy reduces bfloat16 and averages itself (a name-based table once
// said it did not, and the bf16 hook fell back to a flat all_gather across every host).
TEST(Hierarchy, TransportsDeclareTypedCapabilities) {
  for (const auto& hosts :
       std::vector<std::vector<std::string>>{kTwoByTwo, {"a", "b"}, {"a", "a"}}) {
    run_on_hosts(hosts, [&](ProcessGroup& pg) {
      const Capabilities& caps = detail::impl_of(pg).caps();
      EXPECT_EQ(caps.name, pg.backend());
      const bool gloo = pg.backend() == "gloo";
      // Gloo sums bfloat16 from LibTorch 2.0 on, not in 1.13.
      EXPECT_EQ(caps.reduces(DType::kBF16), !gloo || TORCH_VERSION_MAJOR >= 2) << pg.backend();
      EXPECT_EQ(caps.native_avg, !gloo) << pg.backend();
      EXPECT_EQ(caps.in_place_comm_buffers, !gloo) << pg.backend();
      EXPECT_EQ(caps.checks_calls, pg.backend() == "shm") << pg.backend();
      EXPECT_TRUE(caps.reduces(DType::kF32));
      EXPECT_FALSE(caps.reduces(DType::kOther));
      EXPECT_EQ(pg.is_comm_buffer(pg.comm_buffer(16, at::kFloat)), !gloo);
    }, kNever, "auto");
  }
}

// The bf16 hook's buckets cross the hierarchy as bfloat16 all_reduces (in shared memory inside
// a host), never as the all_gather fallback of transports without a bfloat16 reduction.
TEST(Hierarchy, Bf16HookAllReducesInsideTheHierarchy) {
  run_on_hosts(kTwoByTwo, [](ProcessGroup& pg) {
    torch::manual_seed(0);
    auto net = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                                     torch::nn::Linear(32, 4));
    std::shared_ptr<ProcessGroup> shared(&pg, [](ProcessGroup*) {});
    DistributedDataParallel model(net.ptr(), {.process_group = shared});
    model.register_comm_hook(comm_hooks::bf16_compress());
    torch::manual_seed(pg.rank());
    model(torch::randn({5, 16})).pow(2).sum().backward();
    int buckets = 0;
    for (const flight::Record& rec : detail::impl_of(pg).recorder->snapshot()) {
      if (rec.bucket < 0) continue;
      ++buckets;
      EXPECT_EQ(rec.call.op, Collective::kAllReduce) << rec.describe();
      EXPECT_EQ(rec.call.dtype, DType::kBF16) << rec.describe();
    }
    EXPECT_GT(buckets, 0);
  });
}

// Each layout with every all_reduce through the hierarchy, every one over flat Gloo (where it
// takes them: float32 and float64; Note [Choosing the all_reduce route]), and a mix by size.
class HierarchyLayouts
    : public ::testing::TestWithParam<std::tuple<std::vector<std::string>, uint64_t>> {};

// Small integers: every reduction has one exact answer. Sizes that split unevenly over the
// local ranks, one element, and more than a staging chunk.
TEST_P(HierarchyLayouts, AllReduceEveryDtypeOpAndSize) {
  const auto& [hosts, flat_from] = GetParam();
  const int n = static_cast<int>(hosts.size());
  run_on_hosts(hosts, [n](ProcessGroup& pg) {
    ASSERT_EQ(pg.backend(), "shm+gloo");
    const int r = pg.rank();
    for (auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf, torch::kInt,
                       torch::kLong}) {
      for (int64_t size : {1, 7, 1001, 70000}) {
        const auto base = torch::arange(size) % 7;
        for (auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kAvg}) {
          if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
          auto t = (base + r).to(dtype);
          pg.all_reduce(t, op).wait();
          at::Tensor want = op == ReduceOp::kSum   ? base * n + n * (n - 1) / 2
                            : op == ReduceOp::kMax ? base + (n - 1)
                            : op == ReduceOp::kMin ? base
                                                   : base.to(torch::kDouble) + (n - 1) / 2.0;
          EXPECT_TRUE(torch::allclose(t.to(torch::kDouble), want.to(dtype).to(torch::kDouble)))
              << c10::toString(dtype) << " x " << size << " " << to_string(op);
        }
      }
    }
  }, flat_from);
}

// DDP-sized tensors (2 and 6 MiB, more than the shm staging chunks): exact results for
// ordinary tensors (staged) and comm buffers (reduced in place), each reduce op.
TEST_P(HierarchyLayouts, LargeAllReducesAreExact) {
  const auto& [hosts, flat_from] = GetParam();
  const int n = static_cast<int>(hosts.size());
  run_on_hosts(hosts, [n](ProcessGroup& pg) {
    const int r = pg.rank();
    for (int64_t size : {int64_t{1} << 19, (int64_t{3} << 19) + 7}) {
      const auto base = torch::arange(size) % 7;
      for (auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
        for (bool comm_buffer : {false, true}) {
          at::Tensor t = comm_buffer ? pg.comm_buffer(size, torch::kFloat)
                                     : torch::empty({size}, torch::kFloat);
          t.copy_(base + r);
          pg.all_reduce(t, op).wait();
          at::Tensor want = op == ReduceOp::kSum   ? base * n + n * (n - 1) / 2
                            : op == ReduceOp::kMax ? base + (n - 1)
                                                   : base.to(torch::kDouble) + (n - 1) / 2.0;
          EXPECT_TRUE(torch::equal(t, want.to(torch::kFloat)))
              << size << " " << to_string(op) << (comm_buffer ? " comm buffer" : "");
        }
      }
    }
  }, flat_from);
}

TEST_P(HierarchyLayouts, ReplicasAreBitIdenticalAndCommBuffersStayInPlace) {
  const auto& [hosts, flat_from] = GetParam();
  const int n = static_cast<int>(hosts.size());
  std::vector<at::Tensor> plain(n), in_place(n), bf16(n), inputs(n);
  // Made here: thread-ranks would race on LibTorch's global generator.
  torch::manual_seed(7);
  for (at::Tensor& v : inputs) v = torch::randn({30001}) * 1000;
  run_on_hosts(hosts, [&](ProcessGroup& pg) {
    const at::Tensor values = inputs[pg.rank()].clone();
    // bfloat16 crosses the rails as bytes, summed once in float32 (bf16_rail_all_reduce).
    at::Tensor h = values.to(torch::kBFloat16);
    pg.all_reduce(h, ReduceOp::kSum).wait();
    bf16[pg.rank()] = h;
    at::Tensor t = values.clone();
    pg.all_reduce(t, ReduceOp::kAvg).wait();
    at::Tensor b = pg.comm_buffer(values.numel(), torch::kFloat);
    EXPECT_TRUE(pg.is_comm_buffer(b));
    b.copy_(values);
    pg.all_reduce(b, ReduceOp::kAvg).wait();
    EXPECT_TRUE(torch::allclose(t, b, 1e-5, 1e-4));
    plain[pg.rank()] = t;
    in_place[pg.rank()] = b.clone();
  }, flat_from);
  at::Tensor exact = torch::zeros({30001}, torch::kDouble);
  at::Tensor magnitude = torch::zeros({30001}, torch::kDouble);
  for (int r = 0; r < n; ++r) {
    const at::Tensor v = inputs[r].to(torch::kBFloat16).to(torch::kDouble);
    exact += v;
    magnitude += v.abs();
  }
  // Rounded to bfloat16 inside a host (half a unit in the last place, 2^-9 of the partial
  // sum), then once more between hosts: within 2^-7 of the summands' magnitude.
  const at::Tensor error = (bf16[0].to(torch::kDouble) - exact).abs();
  EXPECT_TRUE((error <= magnitude / 128).all().item<bool>())
      << error.max().item<double>();
  for (int r = 1; r < n; ++r) {
    EXPECT_TRUE(torch::equal(plain[0], plain[r])) << r;
    EXPECT_TRUE(torch::equal(in_place[0], in_place[r])) << r;
    EXPECT_TRUE(torch::equal(bf16[0], bf16[r])) << r;
  }
}

// Every collective travels through the hierarchy (shm inside a host, the rails between hosts):
// exact results for every root, dtype, size (uneven splits, one element, more than a staging
// chunk) and reduce op; types the shm kernels do not know (complex) move as bytes.
TEST_P(HierarchyLayouts, EveryCollectiveIsExact) {
  const auto& [hosts, flat_from] = GetParam();
  const int n = static_cast<int>(hosts.size());
  run_on_hosts(hosts, [n](ProcessGroup& pg) {
    ASSERT_EQ(pg.backend(), "shm+gloo");
    const int r = pg.rank();
    for (auto dtype : {torch::kDouble, torch::kBFloat16, torch::kLong, torch::kBool}) {
      for (int64_t size : {1, 7, 1001, 70000}) {
        SCOPED_TRACE(fmt::format("{} x {}", c10::toString(dtype), size));
        auto values = [&](int who) { return ((torch::arange(size) + who * 3) % 11).to(dtype); };
        for (int root = 0; root < n; ++root) {
          auto t = values(r);
          pg.broadcast(t, root).wait();
          EXPECT_TRUE(torch::equal(t, values(root))) << "root " << root;
        }
        std::vector<at::Tensor> out(n);
        for (auto& o : out) o = torch::empty({size}, dtype);
        pg.all_gather(out, values(r)).wait();
        for (int p = 0; p < n; ++p) EXPECT_TRUE(torch::equal(out[p], values(p))) << "from " << p;
        if (dtype == torch::kBool) continue;
        for (auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kAvg}) {
          if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
          // inputs[j] of rank i: (arange + 7 i + j) % 5, small integers with exact answers.
          auto input = [&](int i, int j) { return (torch::arange(size) + 7 * i + j) % 5; };
          std::vector<at::Tensor> inputs, mine;
          for (int j = 0; j < n; ++j) inputs.push_back(input(r, j).to(dtype));
          for (int i = 0; i < n; ++i) mine.push_back(input(i, r));
          const at::Tensor all = torch::stack(mine);
          at::Tensor want = op == ReduceOp::kSum   ? all.sum(0)
                            : op == ReduceOp::kMax ? std::get<0>(all.max(0))
                            : op == ReduceOp::kMin ? std::get<0>(all.min(0))
                                                   : all.to(torch::kDouble).mean(0);
          auto got = torch::empty({size}, dtype);
          pg.reduce_scatter(got, inputs, op).wait();
          EXPECT_TRUE(torch::allclose(got.to(torch::kDouble), want.to(dtype).to(torch::kDouble)))
              << to_string(op);
        }
      }
    }
    // A type no shm kernel knows: moved as bytes (broadcast, all_gather); not reduced.
    auto z = torch::full({9}, c10::complex<double>(r, -r));
    pg.broadcast(z, 1).wait();
    EXPECT_TRUE(torch::equal(z, torch::full({9}, c10::complex<double>(1, -1))));
    std::vector<at::Tensor> zs(n);
    for (auto& o : zs) o = torch::empty_like(z);
    pg.all_gather(zs, torch::full({9}, c10::complex<double>(r, r))).wait();
    for (int p = 0; p < n; ++p) {
      EXPECT_TRUE(torch::equal(zs[p], torch::full({9}, c10::complex<double>(p, p))));
    }
    auto zsum = torch::full({9}, c10::complex<double>(1, 2));
    const uint64_t before = pg.last_sequence_number();
    try {
      pg.all_reduce(zsum).wait();
      ADD_FAILURE() << "reduced a complex tensor";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the shm+gloo backend cannot reduce Complex"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(pg.last_sequence_number(), before) << "a refused call takes no number";
    pg.barrier().wait();
    // Non-contiguous tensors are staged and written back.
    auto wide = torch::zeros({4, 6}, torch::kFloat);
    auto column = wide.select(1, 2);
    if (r == 0) column.fill_(5);
    pg.broadcast(column, 0).wait();
    EXPECT_TRUE(torch::equal(wide.select(1, 2), torch::full({4}, 5.0f)));
    EXPECT_EQ(wide.sum().item<float>(), 20.0f);
    // all_reduce and the others interleaved, waited in reverse.
    auto a = torch::full({3000}, 1.0f);
    auto c = torch::full({10}, float(r));
    Work wa = pg.all_reduce(a);
    Work wc = pg.broadcast(c, n - 1);
    wc.wait();
    wa.wait();
    EXPECT_TRUE(torch::equal(a, torch::full({3000}, float(n))));
    EXPECT_TRUE(torch::equal(c, torch::full({10}, float(n - 1))));
  }, flat_from);
}

INSTANTIATE_TEST_SUITE_P(
    Hosts, HierarchyLayouts,
    ::testing::Combine(::testing::Values(kTwoByTwo, kThreeByTwo),
                       ::testing::Values(kNever, uint64_t{0}, uint64_t{64} << 10)),
    [](const auto& info) {
      const uint64_t from = std::get<1>(info.param);
      return fmt::format("{}hosts_{}", std::get<0>(info.param).size() / 2,
                         from == kNever ? "hierarchy" : from == 0 ? "flat" : "flat_from_64KiB");
    });

// DDP over either route, and over a mix (buckets of 16-128 KiB on both sides of 64 KiB): the
// replicas stay bit-identical within a run, and the routes agree up to the order of the sums.
TEST(Hierarchy, DdpTrainsTheSameOverEitherRoute) {
  torch::manual_seed(3);
  std::vector<at::Tensor> inputs, targets;  // made here: thread-ranks race on the generator
  for (int r = 0; r < 4; ++r) {
    inputs.push_back(torch::randn({3, 8, 64}));
    targets.push_back(torch::randn({3, 8, 10}));
  }
  std::map<uint64_t, std::vector<at::Tensor>> trained;  // route -> each rank's parameters
  for (const uint64_t flat_from : {kNever, uint64_t{0}, uint64_t{64} << 10}) {
    std::vector<torch::nn::Sequential> nets;
    for (int r = 0; r < 4; ++r) {
      torch::manual_seed(5);
      nets.push_back(torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                                           torch::nn::Linear(256, 128), torch::nn::ReLU(),
                                           torch::nn::Linear(128, 10)));
    }
    std::vector<at::Tensor>& out = trained[flat_from];
    out.resize(4);
    run_on_hosts(
        kTwoByTwo,
        [&](ProcessGroup& pg) {
          torch::nn::Sequential net = nets[pg.rank()];
          std::shared_ptr<ProcessGroup> shared(&pg, [](ProcessGroup*) {});
          DistributedDataParallel model(
              net.ptr(), {.process_group = shared, .bucket_cap_mb = 0.1, .first_bucket_mb = 0.1});
          torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          for (int step = 0; step < 3; ++step) {
            opt.zero_grad();
            torch::mse_loss(model(inputs[pg.rank()][step]), targets[pg.rank()][step]).backward();
            opt.step();
          }
          out[pg.rank()] = torch::nn::utils::parameters_to_vector(net->parameters());
        },
        flat_from);
    for (int r = 1; r < 4; ++r) EXPECT_TRUE(torch::equal(out[0], out[r])) << flat_from << " " << r;
  }
  EXPECT_TRUE(torch::allclose(trained[0][0], trained[kNever][0], 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(trained[uint64_t{64} << 10][0], trained[kNever][0], 1e-5, 1e-6));
}

// A rank that leaves: every other rank fails within the timeout, none hangs.
TEST(Hierarchy, ARankThatLeavesFailsEveryoneInBoundedTime) {
  const int port = testing::free_port();
  std::vector<std::string> messages(4);
  std::vector<double> waited(4);
  std::latch gone(1);
  auto errors = run_threads(4, [&](int r) {
    auto pg = make_process_group(on_host(r, kTwoByTwo, port, /*timeout=*/5s));
    auto warm = torch::ones({100});
    pg->all_reduce(warm).wait();
    if (r == 3) {
      pg.reset();
      gone.count_down();
      return;
    }
    gone.wait();
    auto t = torch::ones({100000});
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->all_reduce(t).wait();
    } catch (const Error& e) {
      messages[r] = e.what();
    }
    waited[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(messages[r]);
    ASSERT_FALSE(errors[r]) << message_of(errors[r]);
    EXPECT_LT(waited[r], 15.0) << r;
    EXPECT_NE(messages[r].find(fmt::format("[rank {}] all_reduce #2", r)), std::string::npos)
        << messages[r];
  }
  // Rank 2 shares rank 3's host: its shared segment names the rank that left.
  EXPECT_NE(messages[2].find("rank 3"), std::string::npos) << messages[2];
}

}  // namespace
}  // namespace ddp
