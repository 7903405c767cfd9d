// bench_loader: is the input pipeline ever the bottleneck?
//
//   build/benchmarks/bench_loader [runs=5]
//
// Measures, on Fashion-MNIST's training set (Debian's dataset-fashion-mnist):
//   * the loader alone: samples/s of a full shuffled pass (0, 1, 2 worker threads; batch 64
//     and 256), median of `runs` passes;
//   * one training step (forward, backward, SGD) of a small CNN on a batch of that size,
//     median of 20 steps;
// and prints the ratio loader-time-per-batch / step-time, plus the time a real training loop
// spends waiting inside the loader's ++ per step (median of 20 steps). A ratio well below 1
// means the loader is not the bottleneck (with workers it also overlaps with the step).
// Expected output (2 shared cores, 1 intra-op thread; numbers vary):
//
//   batch  workers  loader samples/s  loader ms/batch  step ms  loader/step    wait in loop ms
//      64        0           1953673            0.033    58.22       0.0006              0.035
//   ...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <torch/torch.h>  // the CNN and its optimizer

#include "ddp/data_loader.h"  // DataLoader, DistributedSampler
#include "ddp/datasets.h"     // FashionMnist
#include "ddp/error.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// conv(1->32, 3x3) relu pool, conv(32->64, 3x3) relu pool, fc(1600->128) relu, fc(128->10).
struct SmallCnnImpl : torch::nn::Module {
  torch::nn::Conv2d c1{torch::nn::Conv2dOptions(1, 32, 3)};
  torch::nn::Conv2d c2{torch::nn::Conv2dOptions(32, 64, 3)};
  torch::nn::Linear f1{64 * 5 * 5, 128};
  torch::nn::Linear f2{128, 10};
  SmallCnnImpl() {
    register_module("c1", c1);
    register_module("c2", c2);
    register_module("f1", f1);
    register_module("f2", f2);
  }
  torch::Tensor forward(torch::Tensor x) {         // [B, 1, 28, 28]
    x = torch::max_pool2d(torch::relu(c1(x)), 2);  // [B, 32, 13, 13]
    x = torch::max_pool2d(torch::relu(c2(x)), 2);  // [B, 64, 5, 5]
    x = torch::relu(f1(x.flatten(1)));             // [B, 128]
    return torch::log_softmax(f2(x), 1);           // [B, 10]
  }
};
TORCH_MODULE(SmallCnn);

struct Trainer {
  SmallCnn net;
  torch::optim::SGD opt{net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)};
  void step(const ddp::Batch& batch) {
    opt.zero_grad();
    auto loss = torch::nll_loss(net->forward(batch.data), batch.target);
    loss.backward();
    opt.step();
  }
};

// Median seconds of one training step on `batch`.
double step_seconds(const ddp::Batch& batch, int steps) {
  torch::manual_seed(0);
  Trainer t;
  std::vector<double> times;
  for (int i = 0; i < steps + 3; ++i) {  // 3 warm-up steps
    const auto t0 = Clock::now();
    t.step(batch);
    if (i >= 3) times.push_back(seconds_since(t0));
  }
  return median(times);
}

// The real loop: median seconds per step that training waits inside the loader's ++ (with
// workers, the next batch is usually ready: the wait is the hand-over only).
double wait_seconds_in_training(const std::shared_ptr<ddp::FashionMnist>& data, int64_t batch,
                                int workers, int steps) {
  torch::manual_seed(0);
  Trainer t;
  ddp::DataLoader loader(data,
                         ddp::DistributedSampler(data->size(), {.num_replicas = 1, .rank = 0}),
                         {.batch_size = batch, .num_workers = workers});
  std::vector<double> waits;
  auto it = loader.begin();
  for (int i = 0; i < steps + 3 && it != loader.end(); ++i) {
    t.step(*it);
    const auto t0 = Clock::now();
    ++it;
    if (i >= 3) waits.push_back(seconds_since(t0));
  }
  return median(waits);
}

// Median samples/s of full shuffled passes.
double loader_samples_per_s(const std::shared_ptr<ddp::FashionMnist>& data, int64_t batch,
                            int workers, int runs) {
  ddp::DistributedSampler sampler(data->size(), {.num_replicas = 1, .rank = 0, .seed = 0});
  ddp::DataLoader loader(data, sampler, {.batch_size = batch, .num_workers = workers});
  std::vector<double> rates;
  for (int r = 0; r < runs + 1; ++r) {  // the first pass warms caches and threads
    sampler.set_epoch(r);
    int64_t samples = 0;
    const auto t0 = Clock::now();
    for (auto& b : loader) samples += b.data.size(0);
    if (r > 0) rates.push_back(static_cast<double>(samples) / seconds_since(t0));
  }
  return median(rates);
}

}  // namespace

int main(int argc, char** argv) {
  const int runs = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  std::shared_ptr<ddp::FashionMnist> data;
  try {
    const auto t0 = Clock::now();
    data = std::make_shared<ddp::FashionMnist>(ddp::Split::kTrain);
    std::printf("Fashion-MNIST train: %lld samples read and decoded in %.2f s\n",
                static_cast<long long>(data->size()), seconds_since(t0));
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "bench_loader: %s\n", e.what());
    return 1;
  }
  std::printf(
      "small CNN (2 conv + 2 fc, 0.23 M params), SGD; torch intra-op threads: %d; "
      "medians of %d passes / 20 steps\n\n",
      torch::get_num_threads(), runs);
  std::printf("%5s  %7s  %16s  %15s  %7s  %11s  %17s\n", "batch", "workers", "loader samples/s",
              "loader ms/batch", "step ms", "loader/step", "wait in loop ms");
  for (int64_t batch : {64, 256}) {
    const double step = step_seconds(data->get_batch([&] {
      std::vector<int64_t> idx(batch);
      for (int64_t i = 0; i < batch; ++i) idx[i] = i;
      return idx;
    }()),
                                     20);
    for (int workers : {0, 1, 2}) {
      const double rate = loader_samples_per_s(data, batch, workers, runs);
      const double per_batch = static_cast<double>(batch) / rate;
      const double wait = wait_seconds_in_training(data, batch, workers, 20);
      std::printf("%5lld  %7d  %16.0f  %15.3f  %7.2f  %11.4f  %17.3f\n",
                  static_cast<long long>(batch), workers, rate, per_batch * 1e3, step * 1e3,
                  per_batch / step, wait * 1e3);
    }
  }
  return 0;
}
