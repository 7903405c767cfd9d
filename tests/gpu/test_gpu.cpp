// CUDA behaviour (label `gpu`): NCCL at world 1 binding its device and completing through CUDA
// events, Gloo and shm moving CUDA tensors between two thread-ranks on one device, DDP on CUDA
// equal to single-process training, fp16 autocast with the gradient scaler, the PowerSGD hook on
// CUDA following the same hook on the CPU, FSDP's ZeRO-3 on CUDA. Every test skips,
// saying why, where no GPU is visible (ctest then reports it skipped): they run on a GPU machine
// (scripts/gpu-check) and compile, at least, in every CUDA build (scripts/test-cuda.sh).
#include <dlfcn.h>     // dladdr
#include <execinfo.h>  // backtrace
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <limits>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "ddp/comm_hooks.h"
#include "ddp/config.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/fully_sharded_data_parallel.h"
#include "ddp/process_group.h"
#include "grad_scaler.h"
#include "process_group/internal.h"
#include "support/ranks.h"
#include "support/saved_state.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

using testing::free_port;
using testing::one_rank_options;
using testing::run_threads;
using testing::thread_rank;

#define SKIP_WITHOUT_GPU()                                                                      \
  do {                                                                                          \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to this process"; \
  } while (0)

const c10::Device kCuda0(c10::kCUDA, 0);

// A crash prints its stack and thread before dying: on a GPU machine lent for minutes the log is
// all there is to read afterwards (a first run died of SIGSEGV in a case with no output at all).
void die_with_backtrace(int sig) {
  char head[96];
  const int len = std::snprintf(head, sizeof head, "test_gpu: signal %d in thread %ld; stack:\n",
                                sig, static_cast<long>(::syscall(SYS_gettid)));
  (void)!::write(STDERR_FILENO, head, static_cast<size_t>(len));
  void* frames[64];
  ::backtrace_symbols_fd(frames, ::backtrace(frames, 64), STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

const bool kCrashesPrintTheirStack = [] {
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) std::signal(sig, die_with_backtrace);
  return true;
}();

// Note [One libstdc++] (src/CMakeLists.txt): pip's LibTorch exports its own static copy of parts
// of libstdc++, whose std::filesystem::remove_all jumped to address 0 when this file's programs
// bound to it. Runs everywhere; it matters where LibTorch comes from a wheel (the GPU check).
TEST(Gpu, StdFilesystemDoesNotResolveIntoLibTorch) {
  std::uintmax_t (*remove_all)(const std::filesystem::path&) = &std::filesystem::remove_all;
  Dl_info info{};
  ASSERT_NE(::dladdr(reinterpret_cast<void*>(remove_all), &info), 0);
  ASSERT_NE(info.dli_fname, nullptr);
  const std::string from = std::filesystem::path(info.dli_fname).filename().string();
  EXPECT_EQ(from.find("libtorch"), std::string::npos) << "remove_all resolves to " << info.dli_fname;
  EXPECT_EQ(from.find("libc10"), std::string::npos) << "remove_all resolves to " << info.dli_fname;
  const std::filesystem::path dir = testing::make_temp_dir("ddp_gpu_libstdcxx");
  std::filesystem::create_directories(dir / "a" / "b");
  EXPECT_EQ(remove_all(dir), 3u);
  EXPECT_FALSE(std::filesystem::exists(dir));
}

// Waits (bounded) until the group's in-flight GPU works are all marked completed.
bool all_completed(ProcessGroup& pg) {
  detail::ProcessGroupImpl& impl = detail::impl_of(pg);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    impl.inflight->sweep(impl.recorder.get(), impl.timeout);
    if (impl.inflight->size() == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

TEST(Gpu, NcclAtWorldOneBindsItsDeviceAndCompletesThroughEvents) {
  SKIP_WITHOUT_GPU();
  if (!DDP_WITH_NCCL) GTEST_SKIP() << "this build has no NCCL backend";
  InitOptions o = one_rank_options();
  o.backend = "nccl";
  auto pg = make_process_group(o);
  EXPECT_EQ(pg->backend(), "nccl");
  ASSERT_TRUE(pg->bound_device_id().has_value());
  EXPECT_EQ(*pg->bound_device_id(), 0);  // LOCAL_RANK 0
  at::Tensor t = torch::arange(8, torch::dtype(torch::kFloat).device(kCuda0));
  pg->all_reduce(t, ReduceOp::kSum).wait();
  pg->broadcast(t, 0).wait();
  std::vector<at::Tensor> out{torch::empty_like(t)};
  pg->all_gather(out, t).wait();
  torch::cuda::synchronize();
  EXPECT_TRUE(torch::equal(out[0].cpu(), torch::arange(8, torch::kFloat)));
  // Each collective was enqueued (its wait returned), then completed by its CUDA event.
  ASSERT_TRUE(all_completed(*pg));
  for (const flight::Record& r : detail::impl_of(*pg).recorder->snapshot()) {
    EXPECT_EQ(r.state, flight::State::kCompleted) << r.describe();
    EXPECT_GT(r.enqueued_us, 0) << r.describe();
    EXPECT_GE(r.completed_us, r.enqueued_us) << r.describe();
  }
}

// CPU tensors over NCCL (metrics, flags, DDP's and the checkpoint's small collectives) are staged
// through the bound device and their results are on the CPU when wait() returns (Note [Staging
// tensors]); ddp-train's first run on a GPU failed on exactly this.
TEST(Gpu, NcclTakesCpuTensorsThroughTheBoundDevice) {
  SKIP_WITHOUT_GPU();
  if (!DDP_WITH_NCCL) GTEST_SKIP() << "this build has no NCCL backend";
  InitOptions o = one_rank_options();
  o.backend = "nccl";
  auto pg = make_process_group(o);
  at::Tensor sum = torch::arange(5, torch::kDouble);
  pg->all_reduce(sum, ReduceOp::kAvg).wait();
  EXPECT_TRUE(sum.device().is_cpu());
  EXPECT_TRUE(torch::equal(sum, torch::arange(5, torch::kDouble)));
  at::Tensor flag = torch::full({1}, 7, torch::kInt);
  pg->all_reduce(flag, ReduceOp::kMax).wait();
  EXPECT_EQ(flag.item<int>(), 7);
  at::Tensor words = torch::arange(3, torch::kLong);
  pg->broadcast(words, 0).wait();
  EXPECT_TRUE(torch::equal(words, torch::arange(3, torch::kLong)));
  // Outputs start uninitialised: only the copy back gives them the input's values.
  std::vector<at::Tensor> out{torch::empty({3}, torch::kLong)};
  pg->all_gather(out, words).wait();
  EXPECT_TRUE(out[0].device().is_cpu());
  EXPECT_TRUE(torch::equal(out[0], words));
  // Mixed with CUDA tensors in one group, in any order.
  at::Tensor g = torch::ones({4}, torch::dtype(torch::kFloat).device(kCuda0));
  Work w = pg->all_reduce(g, ReduceOp::kSum);
  at::Tensor after = torch::full({1}, 2.5, torch::kFloat);
  pg->all_reduce(after, ReduceOp::kSum).wait();
  w.wait();
  EXPECT_FLOAT_EQ(after.item<float>(), 2.5f);
  EXPECT_TRUE(torch::equal(g.cpu(), torch::ones({4})));
  ASSERT_TRUE(all_completed(*pg));
}

// Two thread-ranks on cuda:0; `backend` moves CUDA tensors itself (Gloo in a CUDA LibTorch) or
// stages them through pinned host memory (shm: Note [Staging tensors]).
void collectives_on_cuda(const std::string& backend) {
  const int port = free_port();
  auto errors = run_threads(2, [&](int r) {
    auto o = thread_rank(r, 2, port);
    o.backend = backend;
    o.host_id.reset();
    o.device_id = 0;
    auto pg = make_process_group(o);
    EXPECT_EQ(*pg->bound_device_id(), 0);
    const auto cuda = torch::dtype(torch::kFloat).device(kCuda0);
    at::Tensor t = torch::full({1000}, static_cast<float>(r + 1), cuda);
    pg->all_reduce(t, ReduceOp::kSum).wait();
    EXPECT_TRUE(torch::equal(t.cpu(), torch::full({1000}, 3.0f))) << backend;
    at::Tensor b = torch::full({5}, static_cast<float>(10 * r + 7), cuda);
    pg->broadcast(b, 1).wait();
    EXPECT_TRUE(torch::equal(b.cpu(), torch::full({5}, 17.0f))) << backend;
    std::vector<at::Tensor> out{torch::empty({3}, cuda), torch::empty({3}, cuda)};
    pg->all_gather(out, torch::full({3}, static_cast<float>(r), cuda)).wait();
    EXPECT_TRUE(torch::equal(out[1].cpu(), torch::full({3}, 1.0f))) << backend;
    EXPECT_TRUE(out[0].is_cuda());
    pg->barrier().wait();
  });
  for (int r = 0; r < 2; ++r) {
    if (errors[r])
      ADD_FAILURE() << backend << " rank " << r << ": " << testing::message_of(errors[r]);
  }
}

TEST(Gpu, GlooMovesCudaTensorsAtWorldTwoOnOneDevice) {
  SKIP_WITHOUT_GPU();
  collectives_on_cuda("gloo");
}

TEST(Gpu, ShmStagesCudaTensorsAtWorldTwoOnOneDevice) {
  SKIP_WITHOUT_GPU();
  collectives_on_cuda("shm");
}

// Note [Backend pairs]: a backend per device type. World 1, NCCL for CUDA tensors and shm for
// CPU ones: each goes to its side as it is (no staging), in one numbering.
TEST(Gpu, NcclPairedWithShmTakesTheCudaTensorsAndShmTheCpuOnes) {
  SKIP_WITHOUT_GPU();
  if (!DDP_WITH_NCCL) GTEST_SKIP() << "this build has no NCCL backend";
  InitOptions o = one_rank_options();
  o.backend = "cpu:shm,cuda:nccl";
  auto pg = make_process_group(o);
  EXPECT_EQ(pg->backend(), "cpu:shm,cuda:nccl");
  ASSERT_TRUE(pg->bound_device_id().has_value());
  at::Tensor g = torch::arange(8, torch::dtype(torch::kFloat).device(kCuda0));
  Work w = pg->all_reduce(g, ReduceOp::kSum);
  at::Tensor c = torch::arange(5, torch::kDouble);
  pg->all_reduce(c, ReduceOp::kAvg).wait();
  EXPECT_TRUE(c.device().is_cpu());
  EXPECT_TRUE(torch::equal(c, torch::arange(5, torch::kDouble)));
  w.wait();
  torch::cuda::synchronize();
  EXPECT_TRUE(torch::equal(g.cpu(), torch::arange(8, torch::kFloat)));
  EXPECT_EQ(pg->last_sequence_number(), 2u);
  // Comm buffers by the device asked for (at world 1 shm's are plain memory, not shared: the
  // CPU side's in-place buffers are checked at world 2 in BackendPairs.*).
  EXPECT_TRUE(pg->comm_buffer(4, torch::kFloat).device().is_cpu());
  EXPECT_TRUE(pg->comm_buffer(4, torch::dtype(torch::kFloat).device(kCuda0)).is_cuda());
  ASSERT_TRUE(all_completed(*pg));
}

// World 2 on one device, Gloo for CUDA tensors (a CUDA LibTorch's Gloo takes them itself) and shm
// for CPU ones.
TEST(Gpu, AGlooAndShmPairRoutesEachTensorByItsDevice) {
  SKIP_WITHOUT_GPU();
  collectives_on_cuda("cpu:shm,cuda:gloo");
  const int port = free_port();
  auto errors = run_threads(2, [&](int r) {
    auto o = thread_rank(r, 2, port);
    o.backend = "cpu:shm,cuda:gloo";
    o.host_id.reset();
    o.device_id = 0;
    auto pg = make_process_group(o);
    at::Tensor g =
        torch::full({16}, static_cast<float>(r + 1), torch::dtype(torch::kFloat).device(kCuda0));
    at::Tensor c = torch::full({16}, static_cast<float>(r + 1));
    Work wg = pg->all_reduce(g, ReduceOp::kSum);
    pg->all_reduce(c, ReduceOp::kSum).wait();
    wg.wait();
    EXPECT_TRUE(torch::equal(g.cpu(), torch::full({16}, 3.0f)));
    EXPECT_TRUE(torch::equal(c, torch::full({16}, 3.0f)));
    pg->barrier().wait();
  });
  for (int r = 0; r < 2; ++r) {
    if (errors[r]) ADD_FAILURE() << "rank " << r << ": " << testing::message_of(errors[r]);
  }
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(8, 32));
    b = register_module("b", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

// DDP on CUDA (NCCL where built, else Gloo; world 1, so no buckets: the wrapper's CUDA
// handling, device_ids and the initial broadcast) takes the same steps as the plain module; two
// processes below exercise the buckets.
TEST(Gpu, DdpOnCudaMatchesSingleProcessTraining) {
  SKIP_WITHOUT_GPU();
  InitOptions o = one_rank_options();
  o.backend = DDP_WITH_NCCL ? "nccl" : "gloo";
  o.device_id = 0;
  auto pg = make_process_group(o);
  torch::manual_seed(3);
  Net plain;
  Net wrapped;
  plain->to(kCuda0);
  wrapped->to(kCuda0);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < plain->parameters().size(); ++i)
      wrapped->parameters()[i].copy_(plain->parameters()[i]);
  }
  DistributedDataParallel<NetImpl> model(wrapped.ptr(), {.process_group = pg, .device_ids = {0}});
  torch::optim::SGD opt_plain(plain->parameters(), 0.1);
  torch::optim::SGD opt_ddp(model.parameters(), 0.1);
  for (int step = 0; step < 5; ++step) {
    const at::Tensor x = torch::randn({16, 8}).to(kCuda0);
    const at::Tensor y = torch::randn({16, 4}).to(kCuda0);
    opt_plain.zero_grad();
    torch::mse_loss(plain->forward(x), y).backward();
    opt_plain.step();
    opt_ddp.zero_grad();
    torch::mse_loss(model(x.cpu()), y).backward();  // device_ids: DDP moves the input
    opt_ddp.step();
  }
  for (size_t i = 0; i < plain->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(plain->parameters()[i], model.parameters()[i], 1e-6, 1e-6))
        << "parameter " << i;
    EXPECT_TRUE(model.parameters()[i].is_cuda());
  }
}

// Note [auto on a GPU]: with a GPU visible, "auto" binds NCCL for CUDA tensors and the CPU's own
// choice (shm at world 1) for CPU tensors, as PyTorch 2.x's default group binds
// "cpu:gloo,cuda:nccl". CPU tensors are not staged through the GPU, a subgroup inherits the pair,
// and DDP on CUDA trains over it as over NCCL alone (one DDP step, a CPU metric between).
TEST(Gpu, AutoOnAGpuPairsNcclWithTheCpuBackend) {
  SKIP_WITHOUT_GPU();
  if (!DDP_WITH_NCCL) GTEST_SKIP() << "this build has no NCCL backend";
  InitOptions o = one_rank_options();
  o.backend = "auto";
  auto pg = make_process_group(o);
  EXPECT_EQ(pg->backend(), "cpu:shm,cuda:nccl");
  ASSERT_TRUE(pg->bound_device_id().has_value());
  EXPECT_EQ(*pg->bound_device_id(), 0);
  EXPECT_TRUE(pg->comm_buffer(4, torch::kFloat).device().is_cpu());
  EXPECT_TRUE(pg->comm_buffer(4, torch::dtype(torch::kFloat).device(kCuda0)).is_cuda());
  at::Tensor c = torch::arange(5, torch::kDouble);
  pg->all_reduce(c, ReduceOp::kAvg).wait();
  EXPECT_TRUE(c.device().is_cpu());
  EXPECT_TRUE(torch::equal(c, torch::arange(5, torch::kDouble)));
  at::Tensor g = torch::arange(8, torch::dtype(torch::kFloat).device(kCuda0));
  pg->all_reduce(g, ReduceOp::kSum).wait();
  torch::cuda::synchronize();
  EXPECT_TRUE(torch::equal(g.cpu(), torch::arange(8, torch::kFloat)));
  auto sub = pg->new_group({0});
  ASSERT_TRUE(sub);
  EXPECT_EQ(sub->backend(), "cpu:shm,cuda:nccl");

  torch::manual_seed(5);
  Net plain;
  Net wrapped;
  plain->to(kCuda0);
  wrapped->to(kCuda0);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < plain->parameters().size(); ++i)
      wrapped->parameters()[i].copy_(plain->parameters()[i]);
  }
  DistributedDataParallel<NetImpl> model(wrapped.ptr(), {.process_group = pg, .device_ids = {0}});
  torch::optim::SGD opt_plain(plain->parameters(), 0.1);
  torch::optim::SGD opt_ddp(model.parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = torch::randn({16, 8}, kCuda0);
    const at::Tensor y = torch::randn({16, 4}, kCuda0);
    opt_plain.zero_grad();
    torch::mse_loss(plain->forward(x), y).backward();
    opt_plain.step();
    opt_ddp.zero_grad();
    at::Tensor loss = torch::mse_loss(model(x), y);
    loss.backward();
    opt_ddp.step();
    at::Tensor metric = loss.detach().cpu().reshape({1});
    pg->all_reduce(metric, ReduceOp::kSum).wait();  // a CPU metric, as ddp-train's
  }
  for (size_t i = 0; i < plain->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(plain->parameters()[i], model.parameters()[i], 1e-6, 1e-6))
        << "parameter " << i;
  }
  ASSERT_TRUE(all_completed(*pg));
}

struct ShardedNetImpl : torch::nn::Module {
  ShardedNetImpl() {
    a = register_module("a", Sharded<torch::nn::LinearImpl>(8, 32));
    b = register_module("b", Sharded<torch::nn::LinearImpl>(32, 32));
    c = register_module("c", Sharded<torch::nn::LinearImpl>(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return c(torch::relu(b(torch::relu(a(x))))); }
  Sharded<torch::nn::LinearImpl> a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(ShardedNet);

// FullyShardedDataParallel on CUDA at world 1 (issue 34): ZeRO-3 units whose flat storage is
// freed and given bytes again through the CUDA allocator (Note [FSDP units]) train as the plain
// module does (a Sharded<M> outside FSDP is M), and never hold every unit at once.
TEST(Gpu, FsdpZeroThreeOnCudaEqualsTheModuleAlone) {
  SKIP_WITHOUT_GPU();
  InitOptions o = one_rank_options();
  o.device_id = 0;
  auto pg = make_process_group(o);
  torch::manual_seed(7);
  ShardedNet plain;
  torch::manual_seed(7);
  ShardedNet sharded;
  plain->to(kCuda0);
  sharded->to(kCuda0);
  FullyShardedDataParallel model(sharded, {.process_group = pg,
                                           .sharding_strategy = ShardingStrategy::kFullShard});
  torch::optim::SGD opt_plain(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD opt_fsdp(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    const at::Tensor x = torch::randn({16, 8}, kCuda0);
    const at::Tensor y = torch::randn({16, 4}, kCuda0);
    opt_plain.zero_grad();
    torch::mse_loss(plain->forward(x), y).backward();
    opt_plain.step();
    opt_fsdp.zero_grad();
    torch::mse_loss(model(x), y).backward();
    opt_fsdp.step();
  }
  const FSDPMemoryStats m = model.memory_stats();  // the training's peak
  const auto full = model.full_parameters();
  EXPECT_EQ(model.memory_stats().peak_gathered_bytes, m.peak_gathered_bytes)
      << "full_parameters() held more than a unit at a time";
  const auto want = plain->parameters();
  ASSERT_EQ(full.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(full[i].second.is_cuda()) << full[i].first;
    EXPECT_TRUE(torch::allclose(full[i].second, want[i], 1e-5, 1e-6))
        << full[i].first << ": max |diff| "
        << (full[i].second - want[i]).abs().max().item<double>();
  }
  EXPECT_LT(m.peak_gathered_bytes, m.full_bytes) << "every unit was whole at once";
  std::printf("FSDP ZeRO-3 on %s over %s: whole model %lld bytes, at most %lld gathered\n",
              kCuda0.str().c_str(), pg->backend().c_str(), static_cast<long long>(m.full_bytes),
              static_cast<long long>(m.peak_gathered_bytes));
}

// DDP across two real processes sharing cuda:0 (device_ids {0}), over Gloo (CUDA tensors
// natively) and shm (staged): after 20 steps, the parameters one process gets on the whole batch.
TEST(Gpu, DdpAcrossTwoProcessesOnOneGpuEqualsOneProcess) {
  SKIP_WITHOUT_GPU();
  const std::string worker = testing::env_or_die("EQUIVALENCE_WORKER");
  const std::string ddprun = testing::env_or_die("DDPRUN");
  const std::filesystem::path dir = testing::make_temp_dir("ddp_gpu_processes");
  const auto one = dir / "one.pt";
  testing::Result ref =
      testing::run_command({.argv = {worker, "mlp", one.string(), "--chunks", "2"},
                            .env = {{"DDP_TEST_DEVICE", "cuda"}},
                            .timeout_s = 120});
  ASSERT_TRUE(ref.exited(0)) << ref.describe();
  for (const std::string backend : {"gloo", "shm"}) {
    SCOPED_TRACE(backend);
    const auto many = dir / (backend + ".pt");
    testing::Result r =
        testing::run_command({.argv = {ddprun, "--standalone", "--nproc-per-node", "2", worker,
                                       "mlp", many.string(), "--chunks", "2"},
                              .env = {{"DDP_TEST_DEVICE", "cuda"}, {"DDP_BACKEND", backend}},
                              .timeout_s = 180});
    ASSERT_TRUE(r.exited(0)) << r.describe();
    testing::expect_same_state(one, many, 1e-5);
  }
  std::filesystem::remove_all(dir);
}

// fp16 autocast with the trainer's gradient scaler: a finite step matches fp32 closely; an
// overflow is caught, the step skipped and the scale backed off.
TEST(Gpu, AmpFp16WithTheGradScaler) {
  SKIP_WITHOUT_GPU();
  auto pg = make_process_group(one_rank_options());
  torch::manual_seed(5);
  Net net;
  net->to(kCuda0);
  const at::Tensor x = torch::randn({64, 8}).to(kCuda0);
  const at::Tensor y = torch::randn({64, 4}).to(kCuda0);
  train::GradScaler scaler;
  std::vector<at::Tensor> params = net->parameters();

  net->zero_grad();
  torch::mse_loss(net->forward(x), y).backward();
  std::vector<at::Tensor> fp32;
  for (const at::Tensor& p : params) fp32.push_back(p.grad().clone());

  net->zero_grad();
  at::autocast::set_enabled(true);
  const at::Tensor out = net->forward(x);
  at::autocast::set_enabled(false);
  at::autocast::clear_cache();
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  scaler.scale(torch::mse_loss(out.to(at::kFloat), y)).backward();
  ASSERT_TRUE(scaler.unscale_and_check(params, *pg));
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), fp32[i], 1e-2, 1e-2)) << "gradient " << i;
  }
  scaler.update(true);

  params[0].mutable_grad().fill_(std::numeric_limits<float>::infinity());
  const double before = scaler.current();
  EXPECT_FALSE(scaler.unscale_and_check(params, *pg));
  scaler.update(false);
  EXPECT_EQ(scaler.current(), before * 0.5);
}

// Matrices of a linear layer, a conv kernel and a classifier, with biases: the loss
// sum_i (p_i * g_i).sum() gives p_i the gradient g_i.
struct MatsImpl : torch::nn::Module {
  MatsImpl() {
    const std::vector<std::vector<int64_t>> shapes = {{64, 32}, {64}, {16, 4, 3, 3}, {10, 64},
                                                      {10}};
    for (size_t i = 0; i < shapes.size(); ++i) {
      params.push_back(register_parameter(fmt::format("p{}", i), torch::zeros(shapes[i])));
    }
  }
  at::Tensor forward(const std::vector<at::Tensor>& grads) {
    at::Tensor loss;
    for (size_t i = 0; i < grads.size(); ++i) {
      at::Tensor term = (params[i] * grads[i].to(params[i].device())).sum();
      loss = loss.defined() ? loss + term : term;
    }
    return loss;
  }
  std::vector<at::Tensor> params;
};
TORCH_MODULE(Mats);

std::vector<at::Tensor> mats_gradients(const Mats& net, int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  std::vector<at::Tensor> g;
  for (const at::Tensor& p : net->params) g.push_back(at::randn(p.sizes(), gen, at::kFloat));
  return g;
}

// The PowerSGD hook with CUDA buckets (NCCL where built, world 1: the hook runs whenever one is
// registered): Q drawn on the CPU and copied, Gram-Schmidt (rank 1) and QR (rank 4) on the GPU,
// state on the device. Its averaged gradients follow the same hook's on the CPU, step after
// step; a state saved from the GPU (state_dict: CPU bytes) loads into a fresh hook, moves back
// to the device, and continues exactly as the uninterrupted run.
TEST(Gpu, PowerSgdOnCudaFollowsTheCpuHook) {
  SKIP_WITHOUT_GPU();
  constexpr int kSteps = 6, kCut = 3;
  for (int rank : {1, 4}) {
    SCOPED_TRACE(fmt::format("matrix_approximation_rank {}", rank));
    const comm_hooks::PowerSGDOptions options{.matrix_approximation_rank = rank,
                                              .start_powerSGD_iter = 2};
    // Averaged gradients of steps [first, kSteps) on `device`; `cut`: stop after kCut steps,
    // carry the state (and bucket order) into a new wrapper and hook, and go on.
    auto run = [&](bool cuda, bool cut) {
      InitOptions o = one_rank_options();
      o.backend = cuda && DDP_WITH_NCCL ? "nccl" : "gloo";
      if (cuda) o.device_id = 0;
      auto pg = make_process_group(o);
      const c10::Device device = cuda ? kCuda0 : c10::Device(c10::kCPU);
      Mats net;
      net->to(device);
      DDPOptions ddp_options{.process_group = pg};
      if (cuda) ddp_options.device_ids = {0};
      auto model = std::make_unique<DistributedDataParallel<MatsImpl>>(net.ptr(), ddp_options);
      auto state = std::make_shared<comm_hooks::PowerSGDState>(options);
      model->register_comm_hook(comm_hooks::powerSGD_hook(state));
      std::vector<std::vector<at::Tensor>> out;
      for (int step = 0; step < kSteps; ++step) {
        if (cut && step == kCut) {
          const auto order = model->bucket_order();
          const std::string bytes = state->state_dict();
          model = std::make_unique<DistributedDataParallel<MatsImpl>>(net.ptr(), ddp_options);
          state = std::make_shared<comm_hooks::PowerSGDState>(options);
          state->load_state_dict(bytes);
          model->register_comm_hook(comm_hooks::powerSGD_hook(state));
          if (!order.empty()) model->restore_bucket_order(order);
        }
        net->zero_grad();
        (*model)(mats_gradients(net, step)).backward();
        std::vector<at::Tensor> grads;
        for (const at::Tensor& p : net->params) grads.push_back(p.grad().cpu().clone());
        out.push_back(std::move(grads));
      }
      return out;
    };
    const auto cpu = run(false, false);
    const auto gpu = run(true, false);
    const auto gpu_cut = run(true, true);
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < cpu[step].size(); ++i) {
        const double scale = std::max(1.0, cpu[step][i].abs().max().item<double>());
        EXPECT_LE((gpu[step][i] - cpu[step][i]).abs().max().item<double>(), 1e-3 * scale)
            << "step " << step << " parameter " << i << ": CUDA and CPU hooks part";
        EXPECT_TRUE(torch::equal(gpu_cut[step][i], gpu[step][i]))
            << "step " << step << " parameter " << i << ": the resumed hook differs";
      }
    }
    // Compressed: a matrix's averaged gradient is not its own gradient (world 1) after start.
    Mats probe;
    EXPECT_FALSE(torch::allclose(gpu[kSteps - 1][0], mats_gradients(probe, kSteps - 1)[0]))
        << "the hook did not compress";
  }
}

}  // namespace
}  // namespace ddp
