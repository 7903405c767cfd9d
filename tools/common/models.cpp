// The tools' models (see models.h).
#include "models.h"

#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/fully_sharded_data_parallel.h"
#include "ddp/sync_batch_norm.h"

namespace ddp::tools {
namespace {

// BatchNorm2d or SyncBatchNorm, behind one type-erased module.
torch::nn::AnyModule norm2d(int64_t channels, bool sync) {
  if (sync) return torch::nn::AnyModule(SyncBatchNorm(channels));
  return torch::nn::AnyModule(torch::nn::BatchNorm2d(channels));
}

// M(args...) registered in `parent` as `name`: M itself, or with `sharded` a ZeRO-3 unit
// ddp::Sharded<M> (which is M outside a FullyShardedDataParallel).
template <typename M, typename... Args>
torch::nn::AnyModule layer(torch::nn::Module& parent, const std::string& name, bool sharded,
                           Args&&... args) {
  if (sharded) {
    return torch::nn::AnyModule(parent.register_module(name, std::make_shared<ShardedImpl<M>>(
                                                                 std::forward<Args>(args)...)));
  }
  return torch::nn::AnyModule(
      parent.register_module(name, std::make_shared<M>(std::forward<Args>(args)...)));
}

// 784 -> hidden... -> 10 with ReLU between: mlp (256, 128), mlp-1024 (1024, 1024), mlp-large
// (2048 x 5). Layers fc1, fc2, ... in order.
struct Mlp : ModelImpl {
  Mlp(const std::vector<int64_t>& hidden, bool sharded) {
    int64_t in = 784;
    for (size_t i = 0; i <= hidden.size(); ++i) {
      const int64_t out = i < hidden.size() ? hidden[i] : 10;
      fc.push_back(
          layer<torch::nn::LinearImpl>(*this, "fc" + std::to_string(i + 1), sharded, in, out));
      in = out;
    }
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = x.flatten(1);
    for (size_t i = 0; i + 1 < fc.size(); ++i) x = torch::relu(fc[i].forward(x));
    return fc.back().forward(x);
  }
  std::vector<torch::nn::AnyModule> fc;
};

struct Cnn : ModelImpl {
  Cnn(bool sync_bn, bool sharded) {
    conv1 = layer<torch::nn::Conv2dImpl>(*this, "conv1", sharded, 1, 32, 3);
    bn1 = norm2d(32, sync_bn);
    register_module("bn1", bn1.ptr());
    conv2 = layer<torch::nn::Conv2dImpl>(*this, "conv2", sharded, 32, 64, 3);
    bn2 = norm2d(64, sync_bn);
    register_module("bn2", bn2.ptr());
    drop1 = register_module("drop1", torch::nn::Dropout(0.25));
    fc1 = layer<torch::nn::LinearImpl>(*this, "fc1", sharded, 9216, 128);  // 64 x 12 x 12
    drop2 = register_module("drop2", torch::nn::Dropout(0.5));
    fc2 = layer<torch::nn::LinearImpl>(*this, "fc2", sharded, 128, 10);
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(bn1.forward(conv1.forward(x)));  // [B, 32, 26, 26]
    x = torch::relu(bn2.forward(conv2.forward(x)));  // [B, 64, 24, 24]
    x = drop1(torch::max_pool2d(x, 2)).flatten(1);   // [B, 9216]
    return fc2.forward(drop2(torch::relu(fc1.forward(x))));
  }
  torch::nn::AnyModule conv1, conv2;
  torch::nn::AnyModule bn1, bn2;
  torch::nn::Dropout drop1{nullptr}, drop2{nullptr};
  torch::nn::AnyModule fc1, fc2;
};

struct BasicBlock : torch::nn::Module {
  BasicBlock(int64_t in, int64_t out, int64_t stride, bool sync_bn) {
    conv1 = register_module(
        "conv1", torch::nn::Conv2d(
                     torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    bn1 = norm2d(out, sync_bn);
    register_module("bn1", bn1.ptr());
    conv2 =
        register_module("conv2", torch::nn::Conv2d(
                                     torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
    bn2 = norm2d(out, sync_bn);
    register_module("bn2", bn2.ptr());
    if (stride != 1 || in != out) {
      shortcut =
          register_module("shortcut",
                          torch::nn::Conv2d(
                              torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
      shortcut_bn = norm2d(out, sync_bn);
      register_module("shortcut_bn", shortcut_bn.ptr());
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(bn1.forward(conv1(x)));
    h = bn2.forward(conv2(h));
    auto skip = shortcut ? shortcut_bn.forward(shortcut(x)) : x;
    return torch::relu(h + skip);
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, shortcut{nullptr};
  torch::nn::AnyModule bn1, bn2, shortcut_bn;
};

// With `sharded` (ZeRO-3), the stem convolution, each residual block (its convolutions and
// BatchNorms together) and the classifier are units; the stem's BatchNorm is the root unit's.
struct ResNet : ModelImpl {
  ResNet(bool sync_bn, bool sharded) {
    stem = layer<torch::nn::Conv2dImpl>(*this, "stem", sharded,
                                        torch::nn::Conv2dOptions(1, 16, 3).padding(1).bias(false));
    stem_bn = norm2d(16, sync_bn);
    register_module("stem_bn", stem_bn.ptr());
    block1 = layer<BasicBlock>(*this, "block1", sharded, 16, 16, 1, sync_bn);
    block2 = layer<BasicBlock>(*this, "block2", sharded, 16, 32, 2, sync_bn);
    block3 = layer<BasicBlock>(*this, "block3", sharded, 32, 64, 2, sync_bn);
    fc = layer<torch::nn::LinearImpl>(*this, "fc", sharded, 64, 10);
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(stem_bn.forward(stem.forward(x)));      // [B, 16, 28, 28]
    x = block3.forward(block2.forward(block1.forward(x)));  // [B, 64, 7, 7]
    return fc.forward(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
  }
  torch::nn::AnyModule stem, stem_bn, block1, block2, block3, fc;
};

// PyTorch's MNIST example (examples/mnist/main.py), returning logits instead of log-softmax:
// cross_entropy(logits) computes what nll_loss(log_softmax) does there.
struct ClassicCnn : ModelImpl {
  explicit ClassicCnn(bool sharded) {
    conv1 = layer<torch::nn::Conv2dImpl>(*this, "conv1", sharded, 1, 32, 3);
    conv2 = layer<torch::nn::Conv2dImpl>(*this, "conv2", sharded, 32, 64, 3);
    drop1 = register_module("drop1", torch::nn::Dropout(0.25));
    fc1 = layer<torch::nn::LinearImpl>(*this, "fc1", sharded, 9216, 128);  // 64 x 12 x 12
    drop2 = register_module("drop2", torch::nn::Dropout(0.5));
    fc2 = layer<torch::nn::LinearImpl>(*this, "fc2", sharded, 128, 10);
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(conv1.forward(x));              // [B, 32, 26, 26]
    x = torch::relu(conv2.forward(x));              // [B, 64, 24, 24]
    x = drop1(torch::max_pool2d(x, 2)).flatten(1);  // [B, 9216]
    return fc2.forward(drop2(torch::relu(fc1.forward(x))));
  }
  torch::nn::AnyModule conv1, conv2;
  torch::nn::Dropout drop1{nullptr}, drop2{nullptr};
  torch::nn::AnyModule fc1, fc2;
};

}  // namespace

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = {"mlp",         "cnn",      "resnet",
                                                 "classic-cnn", "mlp-1024", "mlp-large"};
  return names;
}

std::shared_ptr<ModelImpl> make_model(const std::string& name, bool sync_bn, bool sharded) {
  const bool has_bn = name == "cnn" || name == "resnet";
  if (sync_bn && !has_bn) {
    throw ConfigError("--sync-bn: model " + name + " has no BatchNorm layers");
  }
  if (name == "mlp") return std::make_shared<Mlp>(std::vector<int64_t>{256, 128}, sharded);
  if (name == "cnn") return std::make_shared<Cnn>(sync_bn, sharded);
  if (name == "resnet") return std::make_shared<ResNet>(sync_bn, sharded);
  if (name == "classic-cnn") return std::make_shared<ClassicCnn>(sharded);
  if (name == "mlp-1024") return std::make_shared<Mlp>(std::vector<int64_t>{1024, 1024}, sharded);
  if (name == "mlp-large") return std::make_shared<Mlp>(std::vector<int64_t>(5, 2048), sharded);
  throw ConfigError("unknown model '" + name +
                    "': choose mlp, cnn, resnet, classic-cnn, mlp-1024 or mlp-large");
}

}  // namespace ddp::tools
