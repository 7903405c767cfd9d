// bench_ddp: what DistributedDataParallel costs and what it hides. Ratios measured side by side
// in one run, medians over repeats (the machine is shared and noisy).
//
//   bench_ddp overhead                      world size 1: CNN step with DDP / without
//   ddprun --standalone --nproc-per-node 2 bench_ddp overlap
//                                           share of all-reduce time not hidden by backward
//   bench_ddp memory                        live heap, 2 ranks: no DDP / DDP / DDP+bucket view
//
// The CNN is the classic small one (PyTorch's MNIST example: 1.2 M parameters) on 28x28
// inputs, batch 64 per rank.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <malloc.h>  // mallinfo2

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "ddp/ddp.h"
#include "ddp/runtime.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct CnnImpl : torch::nn::Module {
  CnnImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(1, 32, 3));
    conv2 = register_module("conv2", torch::nn::Conv2d(32, 64, 3));
    fc1 = register_module("fc1", torch::nn::Linear(9216, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(conv2(torch::relu(conv1(x))));
    h = torch::max_pool2d(h, 2).flatten(1);
    return fc2(torch::relu(fc1(h)));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Cnn);

constexpr int64_t kBatch = 64;

template <typename Model>
double time_steps(Model& model, torch::optim::SGD& opt, int steps) {
  auto x = torch::randn({kBatch, 1, 28, 28});
  auto y = torch::randint(0, 10, {kBatch});
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    torch::cross_entropy_loss(model(x), y).backward();
    opt.step();
  }
  return std::chrono::duration<double>(Clock::now() - start).count() / steps;
}

int overhead(int steps, int repeats) {
  ddp::InitOptions one;
  one.rank = 0;
  one.world_size = 1;
  auto pg = ddp::make_process_group(one);
  Cnn plain, wrapped_net, hooked_net;
  torch::optim::SGD opt_plain(plain->parameters(), 0.01);
  ddp::DistributedDataParallel wrapped(wrapped_net, {.process_group = pg});
  torch::optim::SGD opt_wrapped(wrapped.parameters(), 0.01);
  // The reducer's full path (buckets, copies, a 1-rank all-reduce), forced by a hook.
  ddp::DistributedDataParallel hooked(hooked_net, {.process_group = pg});
  hooked.register_comm_hook(ddp::comm_hooks::allreduce());
  torch::optim::SGD opt_hooked(hooked.parameters(), 0.01);
  time_steps(plain, opt_plain, 3);
  time_steps(wrapped, opt_wrapped, 3);
  time_steps(hooked, opt_hooked, 3);
  std::vector<double> t_plain, t_ddp, t_hooked, r_ddp, r_hooked;
  for (int r = 0; r < repeats; ++r) {  // interleaved, so drift hits all three alike
    t_plain.push_back(time_steps(plain, opt_plain, steps));
    t_ddp.push_back(time_steps(wrapped, opt_wrapped, steps));
    t_hooked.push_back(time_steps(hooked, opt_hooked, steps));
    r_ddp.push_back(t_ddp.back() / t_plain.back());
    r_hooked.push_back(t_hooked.back() / t_plain.back());
  }
  std::printf("overhead at world size 1 (CNN, batch %lld, %d threads, median of %d x %d steps)\n",
              static_cast<long long>(kBatch), torch::get_num_threads(), repeats, steps);
  std::printf("  %-34s %8.2f ms/step\n", "no DDP", median(t_plain) * 1e3);
  std::printf("  %-34s %8.2f ms/step  ratio %.3f\n", "DDP (default)", median(t_ddp) * 1e3,
              median(r_ddp));
  std::printf("  %-34s %8.2f ms/step  ratio %.3f\n", "DDP, reducer forced (allreduce hook)",
              median(t_hooked) * 1e3, median(r_hooked));
  return 0;
}

int overlap(int steps) {
  auto pg = ddp::init_process_group();
  Cnn net;
  ddp::DistributedDataParallel model(net, {});
  torch::optim::SGD opt(model.parameters(), 0.01);
  auto x = torch::randn({kBatch, 1, 28, 28});
  auto y = torch::randint(0, 10, {kBatch});
  std::vector<double> exposed, step_time, backward_span;
  for (int i = 0; i < steps + 5; ++i) {
    const auto start = Clock::now();
    opt.zero_grad();
    torch::cross_entropy_loss(model(x), y).backward();
    opt.step();
    if (i < 5) continue;  // warm-up, and the one-time bucket rebuild
    const ddp::IterationStats& s = model.last_iteration_stats();
    exposed.push_back(s.finalize_end_s - s.finalize_start_s);
    backward_span.push_back(s.last_gradient_s);
    step_time.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  // The same buckets all-reduced alone, nothing else running: the communication to hide.
  std::vector<double> alone;
  const auto layout = model.bucket_layout();
  auto named = net->named_parameters();
  for (int i = 0; i < steps; ++i) {
    const auto start = Clock::now();
    for (const auto& bucket : layout) {
      int64_t numel = 0;
      for (const auto& name : bucket) numel += named[name].numel();
      auto t = torch::ones({numel});
      pg->all_reduce(t).wait();
    }
    alone.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  if (pg->rank() == 0) {
    std::printf(
        "overlap at world size %d (CNN, batch %lld per rank, %zu buckets, median of %d "
        "steps)\n",
        pg->size(), static_cast<long long>(kBatch), layout.size(), steps);
    std::printf("  step time                       %8.2f ms\n", median(step_time) * 1e3);
    std::printf("  backward (first to last grad)   %8.2f ms\n", median(backward_span) * 1e3);
    std::printf("  all-reduce of all buckets alone %8.2f ms\n", median(alone) * 1e3);
    std::printf("  exposed after backward          %8.2f ms\n", median(exposed) * 1e3);
    std::printf("  share not hidden behind backward  %.1f %%\n",
                100.0 * median(exposed) / median(alone));
  }
  ddp::barrier();
  ddp::destroy_process_group();
  return 0;
}

// Bytes malloc has handed out and not taken back (arena + mmapped chunks): live memory,
// unlike RSS, which also holds what the allocator keeps after free().
double live_heap_mib() {
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<double>(mi.uordblks + mi.hblkhd) / 1048576.0;
}

struct BigMlpImpl : torch::nn::Module {
  BigMlpImpl() {
    for (int i = 0; i < 6; ++i) {
      std::string name = "l";  // not "l" + ...: GCC 12 warns falsely on that insert at -O3
      name += std::to_string(i);
      layers.push_back(register_module(name, torch::nn::Linear(2048, 2048)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::relu(l(x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(BigMlp);

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// One configuration, in a fresh process: 2 thread-ranks train 4 steps; prints the live heap
// right after backward (when gradients, and buckets, exist), median of steps 2-4 (step 1
// first allocates gradients and then moves them into buckets).
int memory_child(const std::string& mode) {
  const int port = free_port();
  std::vector<double> samples;  // written by rank 0 only
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      ddp::InitOptions o;
      o.rank = r;
      o.world_size = 2;
      o.master_addr = "127.0.0.1";
      o.master_port = port;
      auto pg = ddp::make_process_group(o);
      BigMlp net;
      torch::optim::SGD opt(net->parameters(), 0.001);
      auto x = torch::randn({16, 2048});
      std::unique_ptr<ddp::DistributedDataParallel<BigMlpImpl>> model;
      if (mode != "none") {
        model = std::make_unique<ddp::DistributedDataParallel<BigMlpImpl>>(
            net.ptr(),
            ddp::DDPOptions{.process_group = pg, .gradient_as_bucket_view = mode == "view"});
      }
      for (int i = 0; i < 4; ++i) {
        opt.zero_grad();
        (model ? (*model)(x) : net(x)).sum().backward();
        pg->barrier().wait();  // both ranks hold their gradients now
        if (r == 0 && i > 0) samples.push_back(live_heap_mib());
        pg->barrier().wait();
        opt.step();
      }
    });
  }
  for (auto& t : ranks) t.join();
  std::printf("%.1f\n", median(samples));
  return 0;
}

double run_memory_child(const char* self, const char* mode) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    execl(self, self, "memory-child", mode, static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  char buf[256];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) out.append(buf, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return out.empty() ? -1 : std::stod(out);
}

int memory(const char* self) {
  const double grads_mib = 6 * (2048.0 * 2048 + 2048) * 4 / 1048576.0;
  std::printf(
      "live heap after backward, 2 ranks as threads, MLP of 6 x Linear(2048, 2048): "
      "%.1f MiB of gradients per rank (medians of 3 fresh processes)\n",
      grads_mib);
  std::vector<double> none, ddp_copy, ddp_view;
  for (int i = 0; i < 3; ++i) {
    none.push_back(run_memory_child(self, "none"));
    ddp_copy.push_back(run_memory_child(self, "copy"));
    ddp_view.push_back(run_memory_child(self, "view"));
  }
  std::printf("  %-36s %8.1f MiB\n", "no DDP", median(none));
  std::printf("  %-36s %8.1f MiB  (+%.1f)\n", "DDP", median(ddp_copy),
              median(ddp_copy) - median(none));
  std::printf("  %-36s %8.1f MiB  (+%.1f)\n", "DDP, gradient_as_bucket_view", median(ddp_view),
              median(ddp_view) - median(none));
  std::printf(
      "  saved by gradient_as_bucket_view: %.1f MiB (one copy of 2 ranks' gradients is "
      "%.1f MiB)\n",
      median(ddp_copy) - median(ddp_view), 2 * grads_mib);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::ensure_fast_blas(argc, argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "overhead") return overhead(/*steps=*/20, /*repeats=*/7);
    if (mode == "overlap") return overlap(/*steps=*/30);
    if (mode == "memory") return memory(argv[0]);
    if (mode == "memory-child" && argc > 2) return memory_child(argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ddp: %s\n", e.what());
    ddp::record_error(e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: bench_ddp overhead | overlap | memory\n");
  return 2;
}
