// ddp_mlp: a complete DistributedDataParallel training loop, on synthetic data so it runs
// anywhere. Every step draws a global batch of --global-batch rows (seeded by the step, the
// same on every rank) and rank r trains on its 1/N of the rows: N processes compute exactly
// what one process computes on the whole batch.
//
//   $ ddprun --standalone --nproc-per-node 2 build/examples/ddp_mlp --steps 100
//   [rank 0]: ddp_mlp: 2 ranks, global batch 64 (32 per rank), 100 steps
//   [rank 0]: step   0  loss 2.3412
//   ...
//   [rank 0]: step  99  loss 0.41..
//
// Options: --steps N, --global-batch G (divisible by the world size), --lr, --save PATH
// (rank 0 saves the trained module), --hook allreduce|fp16|bf16, --bucket-cap-mb MB.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <torch/torch.h>

#include "ddp/ddp.h"
#include "ddp/runtime.h"  // ensure_fast_blas

namespace {

struct Options {
  int steps = 100;
  int64_t global_batch = 64;
  double lr = 0.05;
  std::string save;
  std::string hook = "allreduce";
  double bucket_cap_mb = ddp::kDefaultBucketCapMb;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    auto value = [&] {
      if (i + 1 >= argc) throw ddp::ConfigError(std::string(argv[i]) + " needs a value");
      return std::string(argv[++i]);
    };
    const std::string flag = argv[i];
    if (flag == "--steps")
      o.steps = std::stoi(value());
    else if (flag == "--global-batch")
      o.global_batch = std::stoll(value());
    else if (flag == "--lr")
      o.lr = std::stod(value());
    else if (flag == "--save")
      o.save = value();
    else if (flag == "--hook")
      o.hook = value();
    else if (flag == "--bucket-cap-mb")
      o.bucket_cap_mb = std::stod(value());
    else
      throw ddp::ConfigError("unknown argument " + flag);
  }
  return o;
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(20, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

// The step's global batch: 20 features, labels from a fixed random linear "teacher".
std::pair<torch::Tensor, torch::Tensor> global_batch(int step, int64_t rows) {
  torch::manual_seed(1000 + step);
  auto x = torch::randn({rows, 20});
  torch::manual_seed(42);
  auto teacher = torch::randn({20, 10});
  return {x, x.matmul(teacher).argmax(1)};
}

int run(const Options& o) {
  auto pg = ddp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  if (o.global_batch % world != 0) {
    throw ddp::ConfigError("--global-batch " + std::to_string(o.global_batch) +
                           " is not divisible by the world size " + std::to_string(world));
  }
  const int64_t per_rank = o.global_batch / world;
  if (rank == 0) {
    std::printf("ddp_mlp: %d ranks, global batch %lld (%lld per rank), %d steps\n", world,
                static_cast<long long>(o.global_batch), static_cast<long long>(per_rank), o.steps);
  }

  torch::manual_seed(rank);  // different on purpose: DDP copies rank 0's weights everywhere
  Net net;
  ddp::DistributedDataParallel model(net, {.bucket_cap_mb = o.bucket_cap_mb});
  if (o.hook == "fp16")
    model.register_comm_hook(ddp::comm_hooks::fp16_compress());
  else if (o.hook == "bf16")
    model.register_comm_hook(ddp::comm_hooks::bf16_compress());
  else if (o.hook != "allreduce")
    throw ddp::ConfigError("unknown --hook " + o.hook);
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(o.lr).momentum(0.9));

  for (int step = 0; step < o.steps; ++step) {
    auto [x, y] = global_batch(step, o.global_batch);
    auto loss = torch::cross_entropy_loss(model(x.narrow(0, rank * per_rank, per_rank)),
                                          y.narrow(0, rank * per_rank, per_rank));
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (rank == 0 && (step % 10 == 0 || step == o.steps - 1)) {
      std::printf("step %3d  loss %.4f\n", step, loss.item<float>());
      std::fflush(stdout);
    }
  }
  if (rank == 0 && !o.save.empty()) torch::save(model.module(), o.save);
  ddp::barrier();
  ddp::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::ensure_fast_blas(argc, argv);
  try {
    return run(parse(argc, argv));
  } catch (const ddp::ConfigError& e) {
    std::fprintf(stderr, "ddp_mlp: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_mlp: %s\n", e.what());
    ddp::record_error(e);
    return 1;
  }
}
