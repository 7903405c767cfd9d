// fsdp_train: a model trained with FullyShardedDataParallel (ZeRO-3), so that each rank keeps
// 1/world of its parameters, gradients and optimizer state between steps instead of all of them.
// The model, 784-2048-2048-2048-2048-2048-10, has 18.4 M parameters (70 MiB); with Adam, a
// DistributedDataParallel replica holds 4 x 70 MiB per rank, ZeRO-3 at world 2 about half that.
//
//   $ ddprun --standalone --nproc-per-node 2 build/examples/fsdp_train [zero3|zero2|zero1|ddp]
//         [EPOCHS] [TRAIN_IMAGES]            (defaults: zero3, 1 epoch, all 60000 images)
//   $ ddprun --standalone --nproc-per-node 2 build/examples/fsdp_train zero3 1 6000
//   [rank 0]: zero3 over 2 ranks: 18.4 M parameters (70.2 MiB); each rank keeps 35.1 MiB of them
//   [rank 0]: epoch 0: loss 0.8871, test accuracy 66.00% (1320/2000)
//   [rank 0]: peak memory: resident 480 MiB, virtual 1275 MiB
//   [rank 1]: peak memory: resident 488 MiB, virtual 1174 MiB
//
// Under a per-process memory limit that a DDP replica exceeds (test_fsdp_memory_limit sets it
// between the two modes' peaks), `ddp` fails on the rank that ran out with "out of memory: ..."
// (init_process_group's uncaught-error handler says what holds the memory) and `zero3` trains
// to the same accuracy:
//   $ MALLOC_ARENA_MAX=1 prlimit --as=$((1200 << 20)) ddprun ... build/examples/fsdp_train ddp 1 6000
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/datasets.h"
#include "ddp/ddp.h"

namespace {

using Layer = ddp::Sharded<torch::nn::LinearImpl>;  // a ZeRO-3 unit; a plain Linear elsewhere

struct DeepMlpImpl : torch::nn::Module {
  DeepMlpImpl(int64_t width, int hidden_layers) {
    int64_t in = 28 * 28;
    for (int i = 0; i <= hidden_layers; ++i) {
      const int64_t out = i < hidden_layers ? width : 10;
      layers.push_back(register_module("fc" + std::to_string(i + 1), Layer(in, out)));
      in = out;
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x.flatten(1);
    for (size_t i = 0; i + 1 < layers.size(); ++i) x = torch::relu(layers[i](x));
    return layers.back()(x);
  }
  std::vector<Layer> layers;
};
TORCH_MODULE(DeepMlp);

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "zero3";
  const int epochs = argc > 2 ? std::atoi(argv[2]) : 1;
  const int64_t train_images = argc > 3 ? std::atoll(argv[3]) : 0;  // 0: all 60000
  if (mode != "zero3" && mode != "zero2" && mode != "zero1" && mode != "ddp") {
    std::fprintf(stderr, "fsdp_train: the mode is zero3, zero2, zero1 or ddp, not '%s'\n",
                 mode.c_str());
    return 2;
  }
  auto pg = ddp::init_process_group();

  torch::manual_seed(0);
  DeepMlp net(2048, 5);
  const int64_t numel = [&] {
    int64_t n = 0;
    for (const auto& p : net->parameters()) n += p.numel();
    return n;
  }();
  // The wrapper, and what the optimizer steps: this rank's shards, or the whole replica.
  std::unique_ptr<ddp::FullyShardedDataParallel<DeepMlpImpl>> fsdp;
  std::unique_ptr<ddp::DistributedDataParallel<DeepMlpImpl>> ddp_model;
  std::vector<torch::Tensor> params;
  if (mode == "ddp" || mode == "zero1") {
    ddp_model = std::make_unique<ddp::DistributedDataParallel<DeepMlpImpl>>(
        net.ptr(), ddp::DDPOptions{.gradient_as_bucket_view = true});
    params = ddp_model->parameters();
  } else {
    fsdp = std::make_unique<ddp::FullyShardedDataParallel<DeepMlpImpl>>(
        net.ptr(), ddp::FSDPOptions{.sharding_strategy =
                                        mode == "zero3" ? ddp::ShardingStrategy::kFullShard
                                                        : ddp::ShardingStrategy::kShardGradOp});
    params = fsdp->parameters();
  }
  auto model = [&](const torch::Tensor& x) { return fsdp ? (*fsdp)(x) : (*ddp_model)(x); };
  // zero1: DDP with Adam's state sharded (ddp::ZeroRedundancyOptimizer), for comparison.
  std::optional<torch::optim::Adam> adam;
  std::optional<ddp::ZeroRedundancyOptimizer> zero1;
  if (mode == "zero1") {
    zero1.emplace(
        ddp::ZeroRedundancyOptimizer::make<torch::optim::Adam>(params,
                                                               torch::optim::AdamOptions(1e-4)));
  } else {
    adam.emplace(params, torch::optim::AdamOptions(1e-4));
  }
  if (ddp::is_main_process()) {
    int64_t kept = 0;
    for (const auto& p : params) kept += p.numel();
    std::printf(
        "%s over %d ranks: %.1f M parameters (%.1f MiB); each rank keeps %.1f MiB of them\n",
        mode.c_str(), pg->size(), numel / 1e6, numel * 4 / 1048576.0, kept * 4 / 1048576.0);
  }

  auto train = std::make_shared<ddp::FashionMnist>(ddp::Split::kTrain,
                                                   ddp::FashionMnistOptions{.limit = train_images});
  auto test = std::make_shared<ddp::FashionMnist>(ddp::Split::kTest,
                                                  ddp::FashionMnistOptions{.limit = 2000});
  ddp::DistributedSampler sampler(train->size(), {.shuffle = true, .seed = 0});
  ddp::DataLoader loader(train, sampler, {.batch_size = 64});
  ddp::DataLoader test_loader(test, ddp::DistributedSampler(test->size(), {.shuffle = false}),
                              {.batch_size = 250});

  for (int epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);
    torch::Tensor loss;
    for (auto& batch : loader) {
      zero1 ? zero1->zero_grad() : adam->zero_grad();
      loss = torch::cross_entropy_loss(model(batch.data), batch.target);
      loss.backward();  // each unit's gradient reduce-scattered as the backward reaches it
      if (zero1) {      // steps this rank's shards
        zero1->step();
      } else {
        adam->step();
      }
    }
    // Accuracy over the test images, each rank a share of them (the forward gathers the units).
    torch::NoGradGuard no_grad;
    torch::Tensor counts = torch::zeros({2}, torch::kInt64);
    for (auto& batch : test_loader) {
      counts[0] += model(batch.data).argmax(1).eq(batch.target).sum();
      counts[1] += batch.target.size(0);
    }
    ddp::all_reduce(counts);
    if (ddp::is_main_process()) {
      const int64_t correct = counts[0].item<int64_t>(), count = counts[1].item<int64_t>();
      std::printf("epoch %d: loss %.4f, test accuracy %.2f%% (%lld/%lld)\n", epoch,
                  loss.item<float>(), 100.0 * correct / count, static_cast<long long>(correct),
                  static_cast<long long>(count));
    }
  }
  // This process's peaks (kB in /proc/self/status): resident (VmHWM) and virtual (VmPeak: what
  // a limit set with `prlimit --as` bounds).
  std::ifstream status("/proc/self/status");
  long resident = 0, virtual_kb = 0;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) resident = std::atol(line.c_str() + 6);
    if (line.rfind("VmPeak:", 0) == 0) virtual_kb = std::atol(line.c_str() + 7);
  }
  std::printf("peak memory: resident %ld MiB, virtual %ld MiB\n", resident / 1024,
              virtual_kb / 1024);
  ddp::destroy_process_group();
}
