// Test support: read back a {name: tensor} dict written with torch::pickle_save (ddp-train's
// model_state.pt, the equivalence worker's output).
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace ddp::testing {

inline std::map<std::string, at::Tensor> load_state(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, at::Tensor> out;
  for (const auto& item : torch::pickle_load(bytes).toGenericDict()) {
    out[item.key().toStringRef()] = item.value().toTensor();
  }
  return out;
}

// Both files hold the same tensors by name, each within `tolerance` (max abs difference).
inline void expect_same_state(const std::filesystem::path& a_path,
                              const std::filesystem::path& b_path, double tolerance) {
  auto a = load_state(a_path), b = load_state(b_path);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) {
    ASSERT_EQ(b.count(name), 1u) << name;
    EXPECT_LE((tensor.to(at::kDouble) - b[name].to(at::kDouble)).abs().max().item<double>(),
              tolerance)
        << name;
  }
}

}  // namespace ddp::testing
