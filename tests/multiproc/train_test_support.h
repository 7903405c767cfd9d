// ddp-train under ddprun, for the end-to-end tests (test_ddp_train.cpp, test_ddp_train_faults.cpp):
// a temporary run folder per test, the command line of a small fast run, and readers of what a
// run leaves behind (metrics.csv, model_state.pt, the "done:" line).
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/saved_state.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp::testing {

inline const std::string kDdprun = env_or_die("DDPRUN");
inline const std::string kTrain = env_or_die("DDP_TRAIN");
inline const std::string kData = "/usr/share/datasets/fashion-mnist";

// ddprun --standalone --nproc-per-node <ranks> <launcher flags> ddp-train <small, fast settings:
// 1536 training images, 24 steps per epoch at 2 ranks> --output-dir <dir/out> <extra>
inline Command train_command(const std::filesystem::path& dir, const std::string& out,
                             const std::vector<std::string>& extra, int ranks = 2,
                             const std::vector<std::string>& launcher = {}) {
  std::vector<std::string> argv = {kDdprun, "--standalone", "--nproc-per-node",
                                   std::to_string(ranks)};
  argv.insert(argv.end(), launcher.begin(), launcher.end());
  argv.insert(argv.end(),
              {kTrain, "--train-subset", "1536", "--test-subset", "1000", "--batch-size", "32",
               "--output-dir", (dir / out).string(), "--log-every", "4", "--workers", "1"});
  argv.insert(argv.end(), extra.begin(), extra.end());
  return {.argv = argv, .timeout_s = 240};
}

// A temporary folder per test, for the runs' output folders.
class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = ddp::testing::make_temp_dir("ddp_train_test"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }

 public:
  Command train(const std::string& out, const std::vector<std::string>& extra, int ranks = 2,
                const std::vector<std::string>& launcher = {}) const {
    return train_command(dir_, out, extra, ranks, launcher);
  }

  std::filesystem::path dir_;  // this test's folder
};

// "test accuracy 81.20% (812/1000)" from the last "done:" line.
inline std::pair<int, int> reported_accuracy(const std::string& out) {
  std::smatch m;
  std::regex re(R"(done: test accuracy [0-9.]+% \((\d+)/(\d+)\))");
  EXPECT_TRUE(std::regex_search(out, m, re)) << out;
  return m.empty() ? std::pair{-1, -1} : std::pair{std::stoi(m[1]), std::stoi(m[2])};
}

// metrics.csv's rows of one split (train/test) as cells.
inline std::vector<std::vector<std::string>> rows(const std::filesystem::path& csv,
                                                  const std::string& split) {
  std::ifstream in(csv);
  std::string line;
  std::vector<std::vector<std::string>> out;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
    if (cells.size() > 2 && cells[2] == split) out.push_back(cells);
  }
  return out;
}

// One numeric column of one split: 0 step, 3 loss, 4 accuracy, 5 lr.
inline std::vector<double> column(const std::filesystem::path& csv, const std::string& split,
                                  int col) {
  std::vector<double> values;
  for (const auto& cells : rows(csv, split)) {
    if (cells.size() > static_cast<size_t>(col)) values.push_back(std::stod(cells[col]));
  }
  return values;
}

// Whether two model_state.pt files hold the same tensors, bit for bit.
inline bool same_weights(const std::filesystem::path& a_file, const std::filesystem::path& b_file) {
  auto a = load_state(a_file);
  auto b = load_state(b_file);
  if (a.size() != b.size()) return false;
  for (const auto& [name, tensor] : a) {
    if (b.count(name) == 0 || !torch::equal(tensor, b.at(name))) return false;
  }
  return true;
}

// Every parameter and buffer of two model_state.pt files equal bit for bit.
inline void expect_same_weights(const std::filesystem::path& a_file,
                                const std::filesystem::path& b_file) {
  auto a = load_state(a_file);
  auto b = load_state(b_file);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) {
    EXPECT_TRUE(torch::equal(tensor, b.at(name))) << name << " differs after resume";
  }
}

}  // namespace ddp::testing
