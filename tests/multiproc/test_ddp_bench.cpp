// ddp-bench end to end, as real processes: the collectives sweep verifies every result alone
// and at 2 ranks under ddprun, reports a backend it cannot form as unavailable and goes on,
// writes its CSV and PNG; the training benchmark runs at 2 ranks with --compare and alone.
// Tiny sizes and few steps: this checks that the tool works, not how fast anything is.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Command;
using testing::Result;
using testing::run_command;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kBench = testing::env_or_die("DDP_BENCH");

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

// The CSV's rows as cells, header first.
std::vector<std::vector<std::string>> read_csv(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::vector<std::string>> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
    rows.push_back(cells);
  }
  return rows;
}

class BenchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ddp_bench_test_XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // ddp-bench alone (ranks == 1) or under ddprun --standalone --nproc-per-node `ranks`.
  Command bench(int ranks, std::vector<std::string> args) {
    std::vector<std::string> argv;
    if (ranks > 1) argv = {kDdprun, "--standalone", "--nproc-per-node", std::to_string(ranks)};
    argv.push_back(kBench);
    argv.insert(argv.end(), args.begin(), args.end());
    return {.argv = argv, .timeout_s = 240};
  }

  // `expected` rows of a tiny sweep are in the CSV, verified, at `ranks` ranks, plus the floor.
  void expect_verified_sweep(const fs::path& csv, int ranks, int expected) {
    const auto rows = read_csv(csv);
    ASSERT_FALSE(rows.empty());
    EXPECT_EQ(rows[0].front(), "backend");
    int measured = 0, floors = 0;
    for (size_t i = 1; i < rows.size(); ++i) {
      const auto& r = rows[i];
      ASSERT_EQ(r.size(), 11u);
      if (r[0] == "memcpy") {
        ++floors;
        EXPECT_GT(std::stod(r[8]), 0) << "memcpy bandwidth";
        continue;
      }
      ++measured;
      EXPECT_EQ(r[0], "gloo");
      EXPECT_EQ(std::stoi(r[3]), ranks);
      EXPECT_GT(std::stod(r[7]), 0) << "time of " << r[1] << " at " << r[4] << " B";
      EXPECT_EQ(r[10], "0") << r[1] << " at " << r[4] << " B had wrong results";
    }
    EXPECT_EQ(floors, 1);
    EXPECT_EQ(measured, expected);
  }

  fs::path dir_;
};

TEST_F(BenchTest, CollectivesAloneVerifyEveryResult) {
  Result r = run_command(bench(1, {"collectives", "--backend", "gloo", "--max-bytes", "64K",
                                   "--iters", "3", "--warmup", "1", "--ring-bytes", "1M",
                                   "--csv", (dir_ / "c.csv").string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("# verified: 0 results wrong"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("memcpy floor"), std::string::npos) << r.out;
  expect_verified_sweep(dir_ / "c.csv", 1, /*4 ops x 14 sizes (8 B .. 64 KiB)*/ 56);
}

TEST_F(BenchTest, CollectivesTwoRanksVerifyAndSkipAnUnavailableBackend) {
  Result r = run_command(bench(2, {"collectives", "--backend", "no-such-backend,gloo",
                                   "--dtype", "float32,int64", "--max-bytes", "16K",
                                   "--iters", "3", "--warmup", "1", "--ring-bytes", "1M",
                                   "--csv", (dir_ / "c.csv").string(),
                                   "--png", (dir_ / "c.png").string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("backend no-such-backend: unavailable, skipped: "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("backend gloo: group of 2 formed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("# verified: 0 results wrong"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[rank 1]: #"), std::string::npos) << "only rank 0 reports";
  // 4 ops x 12 sizes (8 B .. 16 KiB) x 2 dtypes, less int64's all_gather and reduce_scatter
  // at 8 B: one element cannot be shared by 2 ranks, so that size is skipped.
  expect_verified_sweep(dir_ / "c.csv", 2, 4 * 12 * 2 - 2);
  if (have_gnuplot()) EXPECT_TRUE(fs::exists(dir_ / "c.png")) << r.out;
}

TEST_F(BenchTest, TrainTwoRanksWithCompare) {
  const fs::path csv = dir_ / "t.csv";
  Result r = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32",
                                   "--steps", "3", "--warmup", "1", "--backend", "gloo",
                                   "--compare", "--csv", csv.string(),
                                   "--png", (dir_ / "t.png").string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  for (const char* s : {"2 ranks x 1 thread (gloo)", "1 process x 1 thread",
                        "1 process x 2 threads", "scaling efficiency at 2 ranks",
                        "vs 1 process x 2 threads"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  }
  const auto rows = read_csv(csv);
  ASSERT_EQ(rows.size(), 4u) << "header and 3 configurations";
  EXPECT_EQ(rows[1][3], "2");  // world size
  EXPECT_EQ(rows[2][3], "1");
  EXPECT_EQ(rows[3][4], "2");  // threads
  for (size_t i = 1; i < rows.size(); ++i) EXPECT_GT(std::stod(rows[i][7]), 0) << "samples/s";
  if (have_gnuplot()) EXPECT_TRUE(fs::exists(dir_ / "t.png")) << r.out;
}

TEST_F(BenchTest, TrainAloneAndRefusesCompareThere) {
  Result r = run_command(bench(1, {"train", "--model", "classic-cnn", "--batch-size", "16",
                                   "--steps", "2", "--warmup", "1", "--threads", "1"}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("1 process x 1 thread"), std::string::npos) << r.out;
  Result c = run_command(bench(1, {"train", "--steps", "1", "--compare"}));
  EXPECT_TRUE(c.exited(2)) << c.describe();
  EXPECT_NE(c.err.find("--compare"), std::string::npos) << c.err;
}

}  // namespace
}  // namespace ddp
