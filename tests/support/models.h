// Test support: small models and data for DDP equivalence tests.
#pragma once

#include <torch/torch.h>

#include "ddp/sync_batch_norm.h"

namespace ddp::testing {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t hidden = 32) {
    fc1 = register_module("fc1", torch::nn::Linear(20, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

// Input [B, 1, 12, 12]. With sync_bn, SyncBatchNorm (over the default group) replaces
// BatchNorm: then N ranks x b rows compute exactly what one process does on N*b rows.
struct CnnImpl : torch::nn::Module {
  explicit CnnImpl(bool sync_bn = false) {
    auto norm = [&](int64_t c) {
      return sync_bn ? torch::nn::AnyModule(SyncBatchNorm(c))
                     : torch::nn::AnyModule(torch::nn::BatchNorm2d(c));
    };
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    bn1 = norm(4);
    register_module("bn1", bn1.ptr());
    conv2 =
        register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 3).stride(2)));
    bn2 = norm(8);
    register_module("bn2", bn2.ptr());
    fc = register_module("fc", torch::nn::Linear(8 * 4 * 4, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1.forward(conv1(x)));
    h = torch::relu(bn2.forward(conv2(h)));
    return fc(h.flatten(1));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::AnyModule bn1, bn2;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Cnn);

// A trunk, a branch applied only to the rows listed in `use_branch` (so on a rank whose rows
// all skip it, the branch gets no gradient), and a layer never used at all.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(20, 10));
    branch = register_module("branch", torch::nn::Linear(20, 10));
    never = register_module("never", torch::nn::Linear(20, 10));
  }
  // chunks: the batch is `chunks` equal parts; part k uses the branch iff use[k].
  torch::Tensor forward(const torch::Tensor& x, const std::vector<bool>& use) {
    auto parts = x.chunk(static_cast<int64_t>(use.size()));
    std::vector<torch::Tensor> outs;
    for (size_t k = 0; k < use.size(); ++k) {
      auto o = trunk(parts[k]);
      if (use[k]) o = o + branch(parts[k]);
      outs.push_back(o);
    }
    return torch::cat(outs);
  }
  torch::nn::Linear trunk{nullptr}, branch{nullptr}, never{nullptr};
};
TORCH_MODULE(Branchy);

// Many small parameters (to force many buckets with a tiny bucket_cap_mb).
struct ManySmallImpl : torch::nn::Module {
  explicit ManySmallImpl(int layers = 24) {
    for (int i = 0; i < layers; ++i) {
      blocks.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(8, 8)));
    }
    in = register_module("in", torch::nn::Linear(20, 8));
    out = register_module("out", torch::nn::Linear(8, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in(x);
    for (auto& b : blocks) h = torch::tanh(b(h));
    return out(h);
  }
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear in{nullptr}, out{nullptr};
};
TORCH_MODULE(ManySmall);

// Largest absolute difference between two modules' parameters (same structure).
inline double max_param_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  double worst = 0;
  for (const auto& item : pa) {
    worst = std::max(worst, (item.value() - pb[item.key()]).abs().max().item<double>());
  }
  return worst;
}

inline void copy_state(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto pt = to.named_parameters();
  for (const auto& item : from.named_parameters()) pt[item.key()].copy_(item.value());
  auto bt = to.named_buffers();
  for (const auto& item : from.named_buffers()) bt[item.key()].copy_(item.value());
}

}  // namespace ddp::testing
