// Fashion-MNIST on N processes with DistributedDataParallel, checkpointed: killed at any point
// and started again, it continues bit for bit (README.md shows this file verbatim).
//   $ ddprun --standalone --nproc-per-node 2 build/examples/readme_train [EPOCHS [CHECKPOINTS]]
//   [rank 0]: epoch 0: loss 0.2093
#include <cstdio>
#include <cstdlib>
#include <string>

#include <torch/torch.h>  // torch::nn, torch::optim, torch::save

#include <ddp/datasets.h>  // FashionMnist
#include <ddp/ddp.h>       // DistributedDataParallel, DistributedSampler, Checkpointer, ...
#include <ddp/runtime.h>   // ensure_fast_blas

struct NetImpl : torch::nn::Module {  // [B, 1, 28, 28] -> 16 maps 13 x 13 -> 128 -> 10 logits
  torch::nn::Conv2d conv{register_module("conv", torch::nn::Conv2d(1, 16, 3))};
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(16 * 13 * 13, 128))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(128, 10))};
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor maps = torch::max_pool2d(torch::relu(conv(x)), 2);  // [B, 16, 13, 13]
    return fc2(torch::relu(fc1(maps.flatten(1))));
  }
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  ddp::ensure_fast_blas(argc, argv);    // optional: see docs/performance.md, BLAS
  auto pg = ddp::init_process_group();  // reads RANK/WORLD_SIZE/... (or MPI/Slurm variables)
  const int epochs = argc > 1 ? std::atoi(argv[1]) : 3;
  const std::string dir = argc > 2 ? argv[2] : "checkpoints";

  // Copies rank 0's weights. Gradients as views into DDP's buckets: no copy in or out of them.
  torch::manual_seed(0);  // LibTorch seeds its generator at random: the same run every time
  ddp::DistributedDataParallel model(Net(), {.gradient_as_bucket_view = true});
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  auto train = std::make_shared<ddp::FashionMnist>(ddp::Split::kTrain);
  ddp::DistributedSampler sampler(train->size(), {.shuffle = true, .seed = 0});
  ddp::DataLoader loader(train, sampler, {.batch_size = 64, .num_workers = 2});

  // What a checkpoint holds. Restored, the run goes on exactly where it stopped.
  ddp::TrainingState state;
  state.add("model", model);      // parameters, buffers and DDP's bucket order
  state.add("optimizer", opt);    // momentum and learning rates
  state.add("sampler", sampler);  // the epoch and the position in it
  state.add("rng", ddp::default_generators());
  ddp::Checkpointer checkpoints(dir, {.keep = 2});
  int64_t step = 0;
  if (auto last = checkpoints.latest_valid(*pg); last.path) {
    step = checkpoints.load(*last.path, state, *pg).meta.step;  // every rank, in place
  }

  for (int64_t epoch = sampler.epoch(); epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);  // keeps a resumed epoch's position; reaches the loader
    torch::Tensor loss;
    for (auto& batch : loader) {
      opt.zero_grad();
      loss = torch::cross_entropy_loss(model(batch.data), batch.target);
      loss.backward();  // all-reduces the gradients while backward runs
      opt.step();
      if (++step % 100 == 0) checkpoints.save(state, {.step = step, .epoch = epoch}, *pg);
    }
    if (ddp::is_main_process() && loss.defined()) {
      std::printf("epoch %lld: loss %.4f\n", static_cast<long long>(epoch), loss.item<float>());
    }
  }
  if (ddp::is_main_process()) torch::save(model.module(), "model.pt");
  ddp::destroy_process_group();
}
