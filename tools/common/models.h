// The models the tools train, shared by ddp-train and ddp-bench. Inputs are Fashion-MNIST
// images [B, 1, 28, 28]; outputs are logits [B, 10].
//
// ddp-train's models:
//   mlp          784-256-128-10 with ReLU                                    ~235 K parameters
//   cnn          the classic small CNN (PyTorch's MNIST example) with BatchNorm after each
//                convolution: conv32-conv64-maxpool-dropout-fc128-dropout-fc10  ~1.2 M
//   resnet       a small ResNet: 3x3 stem, three BasicBlocks (16, 32, 64 channels), avgpool,
//                fc                                                          ~78 K parameters
// The comparison models (benchmarks/vs_pytorch builds the same ones in torch.nn):
//   classic-cnn  PyTorch's MNIST example exactly: conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU,
//                maxpool 2, dropout 0.25, fc 9216->128, ReLU, dropout 0.5, fc 128->10
//                                                         1.2 M parameters, 4.6 MiB of gradients
//   mlp-1024     784-1024-1024-10 with ReLU               1.9 M parameters, 7.1 MiB of gradients
// The large model, for FullyShardedDataParallel (its DDP replica with Adam's state is 4 x 70 MiB
// per rank):
//   mlp-large    784-2048-2048-2048-2048-2048-10 with ReLU
//                                                        18.4 M parameters, 70.2 MiB of gradients
// `sync_bn` builds ddp::SyncBatchNorm where BatchNorm goes (a C++ parent calls its children
// through its own members, so the choice is made at construction; see ddp/sync_batch_norm.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

namespace ddp::tools {

// A model plus how to call it: every model here takes one tensor and returns one.
struct ModelImpl : torch::nn::Module {
  virtual torch::Tensor forward(torch::Tensor x) = 0;
};

// Every name make_model() accepts, in the order help texts list them.
const std::vector<std::string>& model_names();

// Throws ddp::ConfigError for an unknown name, or sync_bn on a model without BatchNorm.
// `sharded`: the layers with parameters (Linear, Conv2d) as ddp::Sharded units, ZeRO-3's units
// under a FullyShardedDataParallel (their parameters are then named "fc1.module.weight"; the
// same model otherwise, drawn from the generator in the same order).
std::shared_ptr<ModelImpl> make_model(const std::string& name, bool sync_bn = false,
                                      bool sharded = false);

}  // namespace ddp::tools
