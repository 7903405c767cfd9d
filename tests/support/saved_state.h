// Test support: read back a {name: tensor} dict written with torch::pickle_save (ddp-train's
// model_state.pt, the equivalence worker's output).
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

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

}  // namespace ddp::testing
