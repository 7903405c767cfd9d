// Shared by the checkpoint tests: a temporary directory, a small model with dropout and buffers,
// a tiny dataset, file helpers and bitwise comparisons.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/datasets.h"
#include "support/temp_dir.h"

namespace ddp::testing {

namespace fs = std::filesystem;

// A fresh directory under $TMPDIR, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() { path_ = ddp::testing::make_temp_dir("ddp-ckpt"); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// Parameters, a BatchNorm (float running stats and an int64 num_batches_tracked buffer) and
// dropout (draws from the default CPU generator, so exact resume needs the RNG state).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t hidden = 32) {
    fc1 = register_module("fc1", torch::nn::Linear(20, hidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    drop = register_module("drop", torch::nn::Dropout(0.3));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(drop(torch::relu(bn(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Net);

// n samples of 20 features, 10 classes; the same for the same seed.
inline std::shared_ptr<TensorDataset> make_dataset(int64_t n, uint64_t seed = 7) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto x = at::randn({n, 20}, gen);
  auto y = at::randint(0, 10, {n}, gen, at::TensorOptions().dtype(at::kLong));
  return std::make_shared<TensorDataset>(x, y);
}

inline std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

inline void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Every parameter and buffer identical, bit for bit (names, shapes, dtypes and values).
inline ::testing::AssertionResult bitwise_equal(torch::nn::Module& a, torch::nn::Module& b) {
  using Dict = torch::OrderedDict<std::string, at::Tensor>;
  auto compare = [](const Dict& xs, const Dict& ys) -> ::testing::AssertionResult {
    if (xs.size() != ys.size()) return ::testing::AssertionFailure() << "different counts";
    for (const auto& x : xs) {
      const at::Tensor* y = ys.find(x.key());
      if (!y) return ::testing::AssertionFailure() << x.key() << " missing";
      if (x.value().scalar_type() != y->scalar_type() || !torch::equal(x.value(), *y)) {
        return ::testing::AssertionFailure()
               << x.key() << " differs (max abs diff "
               << (x.value().to(at::kDouble) - y->to(at::kDouble)).abs().max().item<double>()
               << ")";
      }
    }
    return ::testing::AssertionSuccess();
  };
  auto r = compare(a.named_parameters(), b.named_parameters());
  if (!r) return r;
  return compare(a.named_buffers(), b.named_buffers());
}

// Deep copies of every parameter and buffer (to check that a failed load changed nothing).
inline std::vector<at::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) out.push_back(b.clone());
  return out;
}

inline bool same_as_snapshot(torch::nn::Module& m, const std::vector<at::Tensor>& snap) {
  std::vector<at::Tensor> now = snapshot(m);
  if (now.size() != snap.size()) return false;
  for (size_t i = 0; i < now.size(); ++i) {
    if (!torch::equal(now[i], snap[i])) return false;
  }
  return true;
}

}  // namespace ddp::testing
