// Test support: what examples/ft_train leaves in its --out folder, read back. Each replica
// writes a line per committed step to steps.<replica id>.txt ("<step> <quorum> <replicas>
// <its rank> <unix ms>") and, if it finishes, its parameters to final.<replica id>.pt. Its
// replica id is "pid<its pid>".
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace ddp::testing {

inline int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One committed step of one replica.
struct Committed {
  int64_t step, quorum;
  int replicas, rank;
  int64_t at_ms;
};

// Each replica's committed steps, by file name ("steps.pid4711.txt").
inline std::map<std::string, std::vector<Committed>> committed(const std::filesystem::path& dir) {
  std::map<std::string, std::vector<Committed>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("steps.")) continue;
    std::ifstream in(e.path());
    for (Committed c; in >> c.step >> c.quorum >> c.replicas >> c.rank >> c.at_ms;) {
      out[name].push_back(c);
    }
  }
  return out;
}

inline std::string steps_file(int pid) { return "steps.pid" + std::to_string(pid) + ".txt"; }

// The replica counts a replica trained at, in order ({3, 2, 3}).
inline std::vector<int> sizes_of(const std::vector<Committed>& steps) {
  std::vector<int> sizes;
  for (const Committed& c : steps) {
    if (sizes.empty() || sizes.back() != c.replicas) sizes.push_back(c.replicas);
  }
  return sizes;
}

inline std::vector<at::Tensor> load_params(const std::filesystem::path& file) {
  std::vector<at::Tensor> params;
  torch::load(params, file.string());
  return params;
}

// Every final.*.pt in `dir`.
inline std::vector<std::vector<at::Tensor>> finals(const std::filesystem::path& dir) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().starts_with("final.")) out.push_back(load_params(e.path()));
  }
  return out;
}

// The replicas' final parameters are bitwise equal.
inline void expect_bitwise_equal(const std::vector<std::vector<at::Tensor>>& all) {
  for (size_t k = 1; k < all.size(); ++k) {
    ASSERT_EQ(all[k].size(), all[0].size());
    for (size_t i = 0; i < all[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(all[k][i], all[0][i])) << "replica " << k << " param " << i;
    }
  }
}

// `a` equals one process's parameters `one` to float tolerance.
inline void expect_close_to_one_process(const std::vector<at::Tensor>& a,
                                        const std::vector<at::Tensor>& one) {
  ASSERT_EQ(one.size(), a.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], one[i], 1e-4, 1e-5))
        << "param " << i << ": " << (a[i] - one[i]).abs().max().item<float>();
  }
}

}  // namespace ddp::testing
