// The models ddp-train offers. Inputs are Fashion-MNIST images [B, 1, 28, 28]; outputs are
// logits [B, 10].
//   mlp     784-256-128-10 with ReLU                                         ~235 K parameters
//   cnn     the classic small CNN (PyTorch's MNIST example) with BatchNorm after each
//           convolution: conv32-conv64-maxpool-dropout-fc128-dropout-fc10    ~1.2 M parameters
//   resnet  a small ResNet: 3x3 stem, three BasicBlocks (16, 32, 64 channels), avgpool, fc
//                                                                            ~78 K parameters
// `sync_bn` builds ddp::SyncBatchNorm where BatchNorm goes (a C++ parent calls its children
// through its own members, so the choice is made at construction; see ddp/sync_batch_norm.h).
#pragma once

#include <memory>
#include <string>

#include <torch/nn/module.h>

namespace ddp::train {

// A model plus how to call it: every ddp-train model takes one tensor and returns one.
struct ModelImpl : torch::nn::Module {
  virtual torch::Tensor forward(torch::Tensor x) = 0;
};

// Throws ddp::ConfigError for an unknown name.
std::shared_ptr<ModelImpl> make_model(const std::string& name, bool sync_bn);

}  // namespace ddp::train
