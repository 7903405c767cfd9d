// Fashion-MNIST on N processes with DistributedDataParallel (README.md shows this file verbatim).
//   $ ddprun --standalone --nproc-per-node 2 build/examples/readme_train [EPOCHS [MAX_STEPS]]
//   [rank 0]: epoch 0: loss 0.4212
#include <cstdio>
#include <cstdlib>

#include <torch/torch.h>  // torch::nn, torch::optim, torch::save

#include <ddp/ddp.h>  // DistributedDataParallel, DistributedSampler, DataLoader, ...

struct NetImpl : torch::nn::Module {  // [B, 1, 28, 28] -> 128 -> 10 logits
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(28 * 28, 128))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(128, 10))};
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  ddp::ensure_fast_blas(argc, argv);  // optional: see "BLAS" below
  ddp::init_process_group();          // reads RANK/WORLD_SIZE/... (or MPI/Slurm variables)
  const int epochs = argc > 1 ? std::atoi(argv[1]) : 3;
  const int max_steps = argc > 2 ? std::atoi(argv[2]) : -1;  // per epoch; -1: the whole epoch

  // Copies rank 0's weights. Gradients as views into DDP's buckets: no copy in or out of them.
  ddp::DistributedDataParallel model(Net(), {.gradient_as_bucket_view = true});
  torch::optim::SGD opt(model.parameters(), 0.1);

  auto train = std::make_shared<ddp::FashionMnist>(ddp::Split::kTrain);
  ddp::DistributedSampler sampler(train->size(), {.shuffle = true, .seed = 0});
  ddp::DataLoader loader(train, sampler, {.batch_size = 64, .num_workers = 2});
  for (int epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);  // reaches the loader (the sampler is shared)
    torch::Tensor loss;
    int step = 0;
    for (auto& batch : loader) {
      if (step++ == max_steps) break;  // every rank has as many batches: all stop together
      opt.zero_grad();
      loss = torch::cross_entropy_loss(model(batch.data), batch.target);
      loss.backward();  // all-reduces the gradients while backward runs
      opt.step();
    }
    if (ddp::is_main_process() && loss.defined()) {
      std::printf("epoch %d: loss %.4f\n", epoch, loss.item<float>());
    }
  }
  if (ddp::is_main_process()) torch::save(model.module(), "model.pt");
  ddp::destroy_process_group();
}
