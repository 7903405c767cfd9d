// Made tests/data/format1/format1.ckpt: a checkpoint of format 1, as ddp-cpp 0.1.0 (commit
// 63541dc, before TrainingState) wrote it. Not part of the build: it compiles only against that
// version's API (CheckpointRefs). Every value is a formula, so the test that loads it
// (tests/unit/test_checkpoint_format.cpp, LegacyFormat1) can check each without this program:
//   model      tests/unit/test_checkpoint_support.h's Net(32): every parameter and float buffer
//              p = (arange(numel) % 97) * 0.001 - 0.05 + 0.1 * (its index in named_parameters
//              then named_buffers), viewed as its shape; num_batches_tracked = 7; then the
//              parameters took the optimizer's step below (p - 0.05 * 0.01)
//   optimizer  SGD(lr 0.05, momentum 0.9) after one step with every gradient 0.01 (momentum
//              buffers 0.01), then lr set to 0.0123
//   sampler    DistributedSampler(50, seed 9), epoch 3, 17 consumed
//   rng        torch::manual_seed(42), then torch::rand({3}) drawn
//   blob       {"bucket_order":[3,2,1,0],"test":{"correct":81,"count":100,"loss_sum":42.5}}
//   meta       step 9, epoch 3, hparams {"lr":0.05}, model label "--model fixture"
// Built and run at 63541dc:
//   g++ -std=c++20 -O1 make.cpp -I<63541dc>/include -I<63541dc>/build/include -I<63541dc>/tests \
//     -I<63541dc>/src $(torch flags) -L<63541dc>/build/src -lddp ... && ./a.out format1.ckpt
#include <torch/torch.h>

#include "ddp/checkpoint.h"
#include "unit/test_checkpoint_support.h"

int main(int argc, char** argv) {
  using ddp::testing::Net;
  Net net(32);
  {
    torch::NoGradGuard no_grad;
    int64_t index = 0;
    auto fill = [&](at::Tensor& t) {
      if (t.scalar_type() == at::kLong) {
        t.fill_(7);
      } else {
        t.copy_((torch::arange(t.numel()) % 97).to(t.dtype()).mul(0.001).sub(0.05)
                    .add(0.1 * static_cast<double>(index)).view(t.sizes()));
      }
      ++index;
    };
    for (auto& p : net->named_parameters()) fill(p.value());
    for (auto& b : net->named_buffers()) fill(b.value());
  }
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (auto& p : net->parameters()) p.mutable_grad() = torch::full_like(p, 0.01);
  opt.step();
  opt.param_groups()[0].options().set_lr(0.0123);
  ddp::DistributedSampler sampler(50, {.num_replicas = 1, .rank = 0, .seed = 9});
  sampler.set_epoch(3);
  sampler.advance(17);
  torch::manual_seed(42);
  torch::rand({3});
  ddp::save_checkpoint(
      argv[1], {.model = net.get(), .optimizer = &opt, .sampler = &sampler},
      {.step = 9,
       .epoch = 3,
       .hparams_json = R"({"lr": 0.05})",
       .blob = R"({"bucket_order":[3,2,1,0],"test":{"correct":81,"count":100,"loss_sum":42.5}})",
       .model_label = "--model fixture"});
  return argc == 2 ? 0 : 1;
}
