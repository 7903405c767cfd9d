// The C ABI (include/ddp/c_api.h), driven as a binding would drive it: ranks as threads, tensors
// as `at::Tensor*` handles (tch-rs's and JavaCPP's), nothing of the C++ API in between. DDP
// through it ends bit for bit where the C++ wrapper ends.
#include <unistd.h>  // getpid

#include <filesystem>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include "ddp/c_api.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/sampler.h"
#include "support/ranks.h"

namespace ddp {
namespace {

using testing::run_ranks;
using testing::run_threads;

// A group through the C ABI for thread-rank `rank` of `world` on `port` (the test backend).
ddp_group* c_group(int rank, int world, int port) {
  ddp_group* g = nullptr;
  const std::string backend = testing::test_backend_for(world);
  const int rc =
      ddp_group_create(DDP_C_API_VERSION, backend.c_str(), rank, world, "127.0.0.1", port, &g);
  if (rc != DDP_OK) throw std::runtime_error(fmt::format("rank {}: {}", rank, ddp_last_error()));
  return g;
}

void ok(int rc) { ASSERT_EQ(rc, DDP_OK) << ddp_last_error(); }

TEST(CApi, CollectivesOnHostMemoryAndTensorHandles) {
  constexpr int kWorld = 3;
  const int port = testing::free_port();
  auto errors = run_threads(kWorld, [&](int rank) {
    ddp_group* g = c_group(rank, kWorld, port);
    EXPECT_EQ(ddp_group_rank(g), rank);
    EXPECT_EQ(ddp_group_size(g), kWorld);
    EXPECT_NE(std::string(ddp_group_backend(g)), "");

    float sum[4] = {1.0f * rank, 2.0f * rank, 3, 4};
    ok(ddp_all_reduce(g, sum, 4, DDP_FLOAT32, DDP_SUM));
    EXPECT_EQ(sum[0], 3.0f);  // 0 + 1 + 2
    EXPECT_EQ(sum[1], 6.0f);
    EXPECT_EQ(sum[3], 12.0f);
    double avg[2] = {1.0 * rank, 10};
    ok(ddp_all_reduce(g, avg, 2, DDP_FLOAT64, DDP_AVG));
    EXPECT_EQ(avg[0], 1.0);
    int64_t big[1] = {rank * 7};
    ok(ddp_all_reduce(g, big, 1, DDP_INT64, DDP_MAX));
    EXPECT_EQ(big[0], 14);

    int32_t b[3] = {rank, rank, rank};
    ok(ddp_broadcast(g, b, 3, DDP_INT32, 2));
    EXPECT_EQ(b[0], 2);

    int32_t mine[2] = {rank, 100 + rank}, all[6] = {};
    ok(ddp_all_gather(g, all, mine, 2, DDP_INT32));
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(all[2 * r], r);
      EXPECT_EQ(all[2 * r + 1], 100 + r);
    }
    float chunks[6] = {0, 1, 10, 11, 20, 21}, got[2] = {};
    ok(ddp_reduce_scatter(g, got, chunks, 2, DDP_FLOAT32, DDP_SUM));
    EXPECT_EQ(got[0], 3.0f * (10 * rank));
    EXPECT_EQ(got[1], 3.0f * (10 * rank + 1));
    int64_t red[1] = {rank + 1};
    ok(ddp_reduce(g, red, 1, DDP_INT64, DDP_SUM, 1));
    if (rank == 1) EXPECT_EQ(red[0], 6);
    ok(ddp_barrier(g));
    // Point to point around the ring, then rank 0 to rank 2 by tensor handle.
    int64_t token[2] = {rank, 100 + rank}, came[2] = {};
    if (rank % 2 == 0) {
      ok(ddp_send(g, token, 2, DDP_INT64, (rank + 1) % kWorld, 5));
      ok(ddp_recv(g, came, 2, DDP_INT64, (rank + kWorld - 1) % kWorld, 5));
    } else {
      ok(ddp_recv(g, came, 2, DDP_INT64, (rank + kWorld - 1) % kWorld, 5));
      ok(ddp_send(g, token, 2, DDP_INT64, (rank + 1) % kWorld, 5));
    }
    EXPECT_EQ(came[1], 100 + (rank + kWorld - 1) % kWorld);
    at::Tensor p2p = torch::full({3}, static_cast<double>(rank), torch::kDouble);
    if (rank == 0) ok(ddp_tensor_send(g, &p2p, 2, 0));
    if (rank == 2) {
      ok(ddp_tensor_recv(g, &p2p, 0, 0));
      EXPECT_TRUE(torch::equal(p2p, torch::zeros({3}, torch::kDouble)));
    }

    // Tensor handles, as a binding holds them.
    at::Tensor t = torch::full({5}, static_cast<float>(rank));
    ok(ddp_tensor_all_reduce(g, &t, DDP_SUM));
    EXPECT_TRUE(torch::equal(t, torch::full({5}, 3.0f)));
    at::Tensor half = torch::full({2}, rank + 0.5, torch::kBFloat16);
    ok(ddp_tensor_broadcast(g, &half, 1));
    EXPECT_TRUE(torch::equal(half, torch::full({2}, 1.5, torch::kBFloat16)));

    // The sampler: PyTorch's shard, as the C++ sampler gives it.
    ddp_sampler* s = nullptr;
    ok(ddp_sampler_create(g, 10, /*shuffle=*/1, /*seed=*/7, /*drop_last=*/0, &s));
    ok(ddp_sampler_set_epoch(s, 3));
    std::vector<int64_t> idx(static_cast<size_t>(ddp_sampler_length(s)));
    size_t written = 0;
    ok(ddp_sampler_indices(s, idx.data(), idx.size(), &written));
    EXPECT_EQ(written, idx.size());
    DistributedSampler same(10, SamplerOptions{.num_replicas = kWorld, .rank = rank, .seed = 7});
    same.set_epoch(3);
    EXPECT_EQ(idx, same.indices());
    EXPECT_EQ(ddp_sampler_indices(s, idx.data(), 1, &written), DDP_E_INVALID);
    EXPECT_NE(std::string(ddp_last_error()).find("room for 1 indices, this epoch has 4"),
              std::string::npos)
        << ddp_last_error();
    ddp_sampler_destroy(s);
    ddp_group_destroy(g);
  });
  for (int r = 0; r < kWorld; ++r) {
    if (errors[r]) ADD_FAILURE() << testing::message_of(errors[r]);
  }
}

// Version 3: gather, scatter and all-to-all on host memory, subgroups, and checkpoints of named
// tensor handles.
TEST(CApi, GatherScatterAllToAllAndSubgroups) {
  constexpr int kWorld = 3;
  const int port = testing::free_port();
  auto errors = run_threads(kWorld, [&](int rank) {
    ddp_group* g = c_group(rank, kWorld, port);
    int32_t mine[2] = {rank, 10 + rank}, all[6] = {};
    ok(ddp_gather(g, rank == 1 ? all : nullptr, mine, 2, DDP_INT32, 1));
    if (rank == 1)
      EXPECT_EQ(std::vector<int32_t>(all, all + 6), (std::vector<int32_t>{0, 10, 1, 11, 2, 12}));
    float parts[3] = {100, 101, 102}, got = -1;
    ok(ddp_scatter(g, &got, rank == 2 ? parts : nullptr, 1, DDP_FLOAT32, 2));
    EXPECT_EQ(got, 100.0f + rank);
    // Chunk j of rank r is 10 r + j: rank j receives 10 r + j from every r.
    int64_t out[3] = {}, in[3] = {10 * rank, 10 * rank + 1, 10 * rank + 2};
    ok(ddp_all_to_all(g, out, in, 1, DDP_INT64));
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(out[r], 10 * r + rank) << r;

    // {2, 0} in any order: ranks 0 and 2 form a group (0 -> 0, 2 -> 1); rank 1 gets NULL.
    const int members[] = {2, 0};
    ddp_group* sub = reinterpret_cast<ddp_group*>(0x1);
    ok(ddp_group_new(g, members, 2, &sub));
    if (rank == 1) {
      EXPECT_EQ(sub, nullptr);
    } else {
      ASSERT_NE(sub, nullptr);
      EXPECT_EQ(ddp_group_size(sub), 2);
      EXPECT_EQ(ddp_group_rank(sub), rank / 2);
      double v[1] = {1.0 + rank};
      ok(ddp_all_reduce(sub, v, 1, DDP_FLOAT64, DDP_SUM));
      EXPECT_EQ(v[0], 4.0);  // 1 + 3: rank 1 is not in it
      ddp_group_destroy(sub);
    }
    ddp_group* whole = nullptr;
    ok(ddp_group_new(g, nullptr, 0, &whole));  // every rank
    ASSERT_NE(whole, nullptr);
    EXPECT_EQ(ddp_group_rank(whole), rank);
    ddp_group_destroy(whole);
    ddp_group_destroy(g);
  });
  for (int r = 0; r < kWorld; ++r) {
    if (errors[r]) ADD_FAILURE() << testing::message_of(errors[r]);
  }
}

// Version 4: the rest of the collectives on tensor handles, with torch.distributed's layouts, and
// a tensor that does not fit is DDP_E_INVALID naming the sizes (nothing is sent).
TEST(CApi, EveryCollectiveOnTensorHandles) {
  constexpr int kWorld = 3;
  const int port = testing::free_port();
  auto errors = run_threads(kWorld, [&](int rank) {
    ddp_group* g = c_group(rank, kWorld, port);
    const float me = static_cast<float>(rank);
    // all_gather_into_tensor: [world * 2, 3] from [2, 3] each.
    at::Tensor in = torch::full({2, 3}, me);
    at::Tensor all = torch::empty({kWorld * 2, 3});
    ok(ddp_tensor_all_gather(g, &all, &in));
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_TRUE(torch::equal(all.narrow(0, 2 * r, 2), torch::full({2, 3}, float(r)))) << r;
    }
    // gather to rank 2 into [world, 2, 3]; the others pass NULL.
    at::Tensor gathered = torch::empty({kWorld, 2, 3});
    ok(ddp_tensor_gather(g, rank == 2 ? &gathered : nullptr, &in, 2));
    if (rank == 2) {
      for (int r = 0; r < kWorld; ++r)
        EXPECT_TRUE(torch::equal(gathered[r], torch::full({2, 3}, float(r)))) << r;
    }
    // reduce_scatter_tensor: block b of rank r holds 10 r + b; rank b gets the sum over r.
    at::Tensor blocks = torch::arange(kWorld, torch::kDouble).repeat_interleave(4) + 10.0 * rank;
    at::Tensor mine = torch::empty({4}, torch::kDouble);
    ok(ddp_tensor_reduce_scatter(g, &mine, &blocks, DDP_SUM));
    EXPECT_TRUE(torch::equal(mine, torch::full({4}, 3.0 * rank + 30.0, torch::kDouble)));
    // scatter from rank 1: rank r gets block r of [world * 2] int64.
    at::Tensor parts = torch::arange(2 * kWorld, torch::kLong);
    at::Tensor part = torch::empty({2}, torch::kLong);
    ok(ddp_tensor_scatter(g, &part, rank == 1 ? &parts : nullptr, 1));
    EXPECT_TRUE(torch::equal(part, torch::arange(2 * rank, 2 * rank + 2, torch::kLong)));
    // reduce to rank 0, max.
    at::Tensor peak = torch::full({3}, me);
    ok(ddp_tensor_reduce(g, &peak, DDP_MAX, 0));
    if (rank == 0) EXPECT_TRUE(torch::equal(peak, torch::full({3}, float(kWorld - 1))));
    // all_to_all_single, equal splits along dim 0: row block j goes to rank j.
    at::Tensor send =
        (torch::arange(kWorld, torch::kInt) + 10 * rank).repeat_interleave(2).view({-1, 1});
    at::Tensor recv = torch::empty({2 * kWorld, 1}, torch::kInt);
    ok(ddp_tensor_all_to_all(g, &recv, &send));
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(recv[2 * r][0].item<int>(), 10 * r + rank) << r;
      EXPECT_EQ(recv[2 * r + 1][0].item<int>(), 10 * r + rank) << r;
    }
    // A gather output of the wrong size: refused on the root before any rank sends (the root
    // checks its own output; every rank then agrees through the next collective as before).
    if (rank == 0) {
      at::Tensor small = torch::empty({kWorld});
      EXPECT_EQ(ddp_tensor_gather(g, &small, &in, 0), DDP_E_INVALID);
      EXPECT_NE(std::string(ddp_last_error()).find("has 3 elements; it needs 18"),
                std::string::npos)
          << ddp_last_error();
      EXPECT_EQ(ddp_tensor_all_gather(g, nullptr, &in), DDP_E_INVALID);
    }
    ddp_group_destroy(g);
  });
  for (int r = 0; r < kWorld; ++r) {
    if (errors[r]) ADD_FAILURE() << testing::message_of(errors[r]);
  }
}

TEST(CApi, CheckpointsOfNamedTensorHandles) {
  constexpr int kWorld = 2;
  const int port = testing::free_port();
  const std::string dir = ::testing::TempDir() + fmt::format("ddp_c_ckpt_{}", getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/weights.ckpt";
  auto errors = run_threads(kWorld, [&](int rank) {
    ddp_group* g = c_group(rank, kWorld, port);
    // Rank 0's values are written; rank 1's differ, and are not.
    at::Tensor w = torch::arange(6, torch::kFloat).view({2, 3}).add(rank).requires_grad_();
    at::Tensor b = torch::full({4}, 7 + rank, torch::kLong);
    const char* names[] = {"layer.weight", "step_count"};
    ddp_tensor handles[] = {&w, &b};
    ok(ddp_checkpoint_save(g, path.c_str(), names, handles, 2, /*step=*/42, /*epoch=*/3));

    // Loaded into other tensors, by name, in another order: rank 0's values on every rank.
    at::Tensor w2 = torch::zeros({2, 3}).requires_grad_(), b2 = torch::zeros({4}, torch::kLong);
    const char* back_names[] = {"step_count", "layer.weight"};
    ddp_tensor back[] = {&b2, &w2};
    int64_t step = -1, epoch = -1;
    ok(ddp_checkpoint_load(g, path.c_str(), back_names, back, 2, &step, &epoch));
    EXPECT_EQ(step, 42);
    EXPECT_EQ(epoch, 3);
    EXPECT_TRUE(torch::equal(w2, torch::arange(6, torch::kFloat).view({2, 3})));
    EXPECT_TRUE(torch::equal(b2, torch::full({4}, 7, torch::kLong)));
    EXPECT_TRUE(w2.requires_grad());

    // A tensor that does not fit changes nothing, and names what differs; so does a name the
    // file lacks. Every rank fails alike.
    at::Tensor wrong = torch::zeros({3, 2}), kept = torch::zeros({4}, torch::kLong);
    const char* two[] = {"step_count", "layer.weight"};
    ddp_tensor wrong_handles[] = {&kept, &wrong};
    EXPECT_EQ(ddp_checkpoint_load(g, path.c_str(), two, wrong_handles, 2, nullptr, nullptr),
              DDP_E_CHECKPOINT);
    EXPECT_NE(std::string(ddp_last_error())
                  .find("'layer.weight' is [2, 3] Float in the file, [3, 2] Float here"),
              std::string::npos)
        << ddp_last_error();
    EXPECT_TRUE(torch::equal(kept, torch::zeros({4}, torch::kLong)));  // not loaded either
    const char* absent[] = {"bias"};
    ddp_tensor one[] = {&kept};
    EXPECT_EQ(ddp_checkpoint_load(g, path.c_str(), absent, one, 1, nullptr, nullptr),
              DDP_E_CHECKPOINT);
    EXPECT_NE(std::string(ddp_last_error()).find("no tensor named 'bias'"), std::string::npos)
        << ddp_last_error();
    ok(ddp_barrier(g));
    ddp_group_destroy(g);
  });
  for (int r = 0; r < kWorld; ++r) {
    if (errors[r]) ADD_FAILURE() << testing::message_of(errors[r]);
  }

  // Without a group: this process alone. A damaged file is refused by name; an unwritable path
  // is an error, and the file there before is left whole.
  at::Tensor x = torch::ones({3}, torch::kDouble);
  const char* name[] = {"x"};
  ddp_tensor h[] = {&x};
  const std::string mine = dir + "/mine.ckpt";
  ok(ddp_checkpoint_save(nullptr, mine.c_str(), name, h, 1, 1, 0));
  const auto size = std::filesystem::file_size(mine);
  std::filesystem::resize_file(mine, size - 5);
  EXPECT_EQ(ddp_checkpoint_load(nullptr, mine.c_str(), name, h, 1, nullptr, nullptr),
            DDP_E_CHECKPOINT);
  EXPECT_NE(std::string(ddp_last_error()).find("truncated"), std::string::npos) << ddp_last_error();
  EXPECT_EQ(ddp_checkpoint_save(nullptr, (dir + "/no/such/folder/x.ckpt").c_str(), name, h, 1, 1,
                                0),
            DDP_E_CHECKPOINT);
  EXPECT_NE(std::string(ddp_last_error()).find("no/such/folder"), std::string::npos)
      << ddp_last_error();
  const char* twice[] = {"x", "x"};
  ddp_tensor hh[] = {&x, &x};
  EXPECT_EQ(ddp_checkpoint_save(nullptr, mine.c_str(), twice, hh, 2, 1, 0), DDP_E_INVALID);
  EXPECT_STREQ(ddp_last_error(), "ddp_checkpoint_save: the name 'x' is given twice");
  std::filesystem::remove_all(dir);
}

TEST(CApi, MistakesAreCodesWithMessagesNeverExceptions) {
  EXPECT_EQ(ddp_abi_version(), DDP_C_API_VERSION);
  EXPECT_STRNE(ddp_version(), "");
  ddp_group* g = nullptr;
  EXPECT_EQ(ddp_group_create(DDP_C_API_VERSION + 1, nullptr, 0, 1, nullptr, 0, &g), DDP_E_ABI);
  EXPECT_EQ(g, nullptr);
  EXPECT_NE(std::string(ddp_last_error())
                .find(
                    fmt::format("built against ddp-cpp's C ABI version {}", DDP_C_API_VERSION + 1)),
            std::string::npos)
      << ddp_last_error();
  float x[1] = {1};
  EXPECT_EQ(ddp_all_reduce(nullptr, x, 1, DDP_FLOAT32, DDP_SUM), DDP_E_INVALID);
  EXPECT_STREQ(ddp_last_error(), "ddp_all_reduce: the group is NULL");
  EXPECT_EQ(ddp_group_create(DDP_C_API_VERSION, "carrier-pigeon", 0, 1, nullptr, 0, &g),
            DDP_E_CONFIG);
  EXPECT_NE(std::string(ddp_last_error()).find("carrier-pigeon"), std::string::npos)
      << ddp_last_error();
  // A program built against version 1 (which lacks send and recv) runs on this library.
  ok(ddp_group_create(1, nullptr, 0, 1, nullptr, 0, &g));
  EXPECT_EQ(ddp_all_reduce(g, x, 1, static_cast<ddp_dtype>(42), DDP_SUM), DDP_E_INVALID);
  EXPECT_STREQ(ddp_last_error(), "ddp_all_reduce: unknown ddp_dtype 42");
  int32_t i[1] = {1};
  EXPECT_EQ(ddp_all_reduce(g, i, 1, DDP_INT32, DDP_AVG), DDP_E_ERROR);
  EXPECT_NE(std::string(ddp_last_error()).find("averaging needs a floating-point tensor"),
            std::string::npos)
      << ddp_last_error();
  EXPECT_EQ(ddp_broadcast(g, x, 1, DDP_FLOAT32, 3), DDP_E_ERROR);
  EXPECT_NE(std::string(ddp_last_error()).find("root rank 3 is not in this group of 1 ranks"),
            std::string::npos)
      << ddp_last_error();
  ddp_model* m = nullptr;
  at::Tensor p = torch::ones({2}, torch::requires_grad());
  ddp_tensor params[] = {&p};
  EXPECT_EQ(ddp_model_create(g, params, 1, 0, 0, "gzip", &m), DDP_E_INVALID);
  EXPECT_NE(std::string(ddp_last_error()).find("unknown comm hook 'gzip'"), std::string::npos);
  EXPECT_EQ(m, nullptr);
  ddp_group_destroy(g);
  ddp_group_destroy(nullptr);
  ddp_model_destroy(nullptr);
  ddp_sampler_destroy(nullptr);
  EXPECT_EQ(ddp_group_rank(nullptr), -1);
}

// A two-layer model's parameters, different on every rank (DDP makes them rank 0's). Each draw
// has its own generator: the ranks are threads, and the global one would race.
std::vector<at::Tensor> make_parameters(int rank) {
  at::Generator gen = at::detail::createCPUGenerator(100 + rank);
  std::vector<at::Tensor> p;
  for (auto shape : {std::vector<int64_t>{8, 4}, {8}, {2, 8}, {2}}) {
    p.push_back(torch::randn(shape, gen).requires_grad_());
  }
  return p;
}

at::Tensor loss_of(const std::vector<at::Tensor>& p, int rank, int step) {
  at::Tensor x = torch::randn({5, 4}, at::detail::createCPUGenerator(1000 + 10 * step + rank));
  at::Tensor h = torch::relu(torch::addmm(p[1], x, p[0].t()));
  return torch::addmm(p[3], h, p[2].t()).pow(2).mean();
}

void sgd(std::vector<at::Tensor>& p) {
  torch::NoGradGuard no_grad;
  for (auto& t : p) {
    t.sub_(t.grad() * 0.1);
    t.grad().zero_();
  }
}

// The module the C++ wrapper trains: the same parameters, the same computation.
struct TwoLayers : torch::nn::Module {
  explicit TwoLayers(const std::vector<at::Tensor>& p) {
    for (size_t i = 0; i < p.size(); ++i) register_parameter(std::to_string(i), p[i]);
  }
  at::Tensor forward(int rank, int step) { return loss_of(parameters(), rank, step); }
};

// Four steps, the middle two accumulated under no_sync: through the C ABI with tensor handles,
// and through DistributedDataParallel<M>. Both end bit for bit equal, and equal on every rank.
TEST(CApi, DdpOverTensorHandlesEqualsTheCppWrapper) {
  constexpr int kWorld = 2, kSteps = 4;
  std::vector<std::vector<at::Tensor>> through_c(kWorld), through_cpp(kWorld);
  const int port = testing::free_port();
  auto errors = run_threads(kWorld, [&](int rank) {
    ddp_group* g = c_group(rank, kWorld, port);
    std::vector<at::Tensor> p = make_parameters(rank);
    std::vector<ddp_tensor> handles;
    for (auto& t : p) handles.push_back(&t);
    ddp_model* m = nullptr;
    ok(ddp_model_create(g, handles.data(), handles.size(), /*bucket_cap_mb=*/0.0001, 0, nullptr,
                        &m));
    for (int step = 0; step < kSteps; ++step) {
      ok(ddp_model_set_no_sync(m, step == 1 || step == 2));
      ok(ddp_model_prepare_forward(m));
      loss_of(p, rank, step).backward();
      if (step == 0 || step == 3) sgd(p);
    }
    ddp_model_destroy(m);
    ddp_group_destroy(g);
    through_c[rank] = p;
  });
  for (int r = 0; r < kWorld; ++r) {
    if (errors[r]) ADD_FAILURE() << testing::message_of(errors[r]);
  }
  run_ranks(kWorld, [&](ProcessGroup& pg) {
    const int rank = pg.rank();
    auto module = std::make_shared<TwoLayers>(make_parameters(rank));
    DDPOptions o;
    o.process_group = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
    o.bucket_cap_mb = 0.0001;
    DistributedDataParallel model(module, o);
    std::vector<at::Tensor> p = module->parameters();
    for (int step = 0; step < kSteps; ++step) {
      auto guard = model.no_sync(step == 1 || step == 2);
      model(rank, step).backward();
      if (step == 0 || step == 3) sgd(p);
    }
    through_cpp[rank] = p;
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(through_c[r].size(), through_cpp[r].size());
    for (size_t i = 0; i < through_c[r].size(); ++i) {
      EXPECT_TRUE(torch::equal(through_c[r][i], through_cpp[r][i]))
          << "rank " << r << " param " << i;
      EXPECT_TRUE(torch::equal(through_c[r][i], through_c[0][i])) << "rank " << r << " param " << i;
    }
  }
  // Not vacuous: the ranks' own starting values were replaced, and training moved them.
  EXPECT_FALSE(torch::equal(through_c[1][0], make_parameters(1)[0]));
  EXPECT_FALSE(torch::equal(through_c[0][0], make_parameters(0)[0]));
}

}  // namespace
}  // namespace ddp
