// ddp-bench end to end, as real processes: the collectives sweep verifies every result alone
// and at 2 ranks under ddprun, reports a backend it cannot form as unavailable and goes on,
// writes its CSV and PNG; the training benchmark runs at 2 ranks with --compare and alone.
// Tiny sizes and few steps: this checks that the tool works, not how fast anything is.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Command;
using testing::Result;
using testing::run_command;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kBench = testing::env_or_die("DDP_BENCH");

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

// The CSV's rows as cells, header first (RFC 4180 quoting: "a,b" is one cell, "" a quote).
std::vector<std::vector<std::string>> read_csv(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::vector<std::string>> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells(1);
    bool quoted = false;
    for (size_t i = 0; i < line.size(); ++i) {
      const char c = line[i];
      if (quoted && c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        cells.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = !quoted;
      } else if (c == ',' && !quoted) {
        cells.emplace_back();
      } else {
        cells.back() += c;
      }
    }
    rows.push_back(cells);
  }
  return rows;
}

class BenchTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = ddp::testing::make_temp_dir("ddp_bench_test"); }
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
  void expect_verified_sweep(const fs::path& csv, int ranks, int expected,
                             std::set<std::string> backends = {"gloo"}) {
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
      EXPECT_TRUE(backends.count(r[0])) << r[0];
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
  Result r = run_command(
      bench(1, {"collectives", "--backend", "gloo", "--max-bytes", "64K", "--iters", "3",
                "--warmup", "1", "--ring-bytes", "1M", "--csv", (dir_ / "c.csv").string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("# verified: 0 results wrong"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("memcpy floor"), std::string::npos) << r.out;
  expect_verified_sweep(dir_ / "c.csv", 1, /*4 ops x 14 sizes (8 B .. 64 KiB)*/ 56);
}

TEST_F(BenchTest, CollectivesTwoRanksVerifyAndSkipAnUnavailableBackend) {
  Result r = run_command(
      bench(2, {"collectives", "--backend", "no-such-backend,gloo", "--dtype", "float32,int64",
                "--max-bytes", "16K", "--iters", "3", "--warmup", "1", "--ring-bytes", "1M",
                "--csv", (dir_ / "c.csv").string(), "--png", (dir_ / "c.png").string()}));
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

// Every collective and dtype between real processes over shared memory, staged and in place
// (comm buffers), at 2, 3 and 4 ranks: sizes from one element to 4 staging chunks.
TEST_F(BenchTest, ShmEveryCollectiveAndDtypeAcrossProcesses) {
  for (int ranks : {2, 3, 4}) {
    SCOPED_TRACE(ranks);
    const fs::path csv = dir_ / fmt::format("shm{}.csv", ranks);
    Command c = bench(ranks, {"collectives", "--backend", "shm,shm-inplace", "--dtype",
                              "float32,float64,bfloat16,float16,int32,int64", "--max-bytes", "64K",
                              "--iters", "2", "--warmup", "1", "--ring-bytes", "256K", "--csv",
                              csv.string()});
    c.env["DDP_SHM_CHUNK_BYTES"] = "16384";
    Result r = run_command(c);
    ASSERT_TRUE(r.exited(0)) << r.describe();
    EXPECT_NE(r.out.find("# verified: 0 results wrong"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("buffers from ProcessGroup::comm_buffer"), std::string::npos) << r.out;
    const auto rows = read_csv(csv);
    int wrong = 0, measured = 0;
    std::set<std::string> seen;
    for (size_t i = 1; i < rows.size(); ++i) {
      if (rows[i][0] == "memcpy") continue;
      ++measured;
      seen.insert(rows[i][0] + "/" + rows[i][1] + "/" + rows[i][2]);
      wrong += std::stoi(rows[i][10]);
    }
    EXPECT_EQ(wrong, 0);
    EXPECT_EQ(seen.size(), 2u * 4 * 6) << "2 backends x 4 ops x 6 dtypes";
    EXPECT_GT(measured, 2 * 4 * 6 * 10);
  }
}

// sendrecv (send and recv, each rank to the next) over Gloo and over shm's mailbox, 3 ranks:
// every result verified.
TEST_F(BenchTest, SendrecvOverGlooAndShmVerifiesEveryResult) {
  const fs::path csv = dir_ / "p2p.csv";
  Result r = run_command(
      bench(3, {"collectives", "--backend", "gloo,shm", "--ops", "sendrecv", "--max-bytes", "64K",
                "--iters", "2", "--warmup", "1", "--ring-bytes", "256K", "--csv", csv.string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("sendrecv (to the next rank, from the previous)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("# verified: 0 results wrong"), std::string::npos) << r.out;
  expect_verified_sweep(csv, 3, /*2 backends x 14 sizes (8 B .. 64 KiB)*/ 28, {"gloo", "shm"});
}

TEST_F(BenchTest, TrainTwoRanksWithCompare) {
  const fs::path csv = dir_ / "t.csv";
  Result r = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32", "--steps",
                                   "3", "--warmup", "1", "--backend", "gloo", "--compare", "--csv",
                                   csv.string(), "--png", (dir_ / "t.png").string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  for (const char* s :
       {"2 ranks x 1 thread (gloo)", "1 process x 1 thread", "1 process x 2 threads",
        "2 ranks x 1 thread (no comm)", "scaling efficiency at 2 ranks", "vs 1 process x 2 threads",
        "of the communication-free ceiling"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  }
  const auto rows = read_csv(csv);
  ASSERT_EQ(rows.size(), 5u) << "header and 4 configurations";
  EXPECT_EQ(rows[1][3], "2");  // world size
  EXPECT_EQ(rows[2][3], "1");
  EXPECT_EQ(rows[3][4], "2");        // threads
  EXPECT_EQ(rows[4][2], "no comm");  // backend column of the ceiling
  EXPECT_EQ(rows[4][3], "2");
  for (size_t i = 1; i < rows.size(); ++i) EXPECT_GT(std::stod(rows[i][7]), 0) << "samples/s";
  if (have_gnuplot()) EXPECT_TRUE(fs::exists(dir_ / "t.png")) << r.out;
}

// A backend per device type holds a comma ("cpu:shm,cuda:gloo"): the CSV quotes it, so the
// columns after it stay in place (the first GPU run with auto's pair read `steps` as samples/s).
TEST_F(BenchTest, TrainOverABackendPairKeepsTheCsvColumns) {
  const fs::path csv = dir_ / "pair.csv";
  Result r = run_command(
      bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32", "--steps", "3", "--warmup",
                "1", "--backend", "cpu:shm,cuda:gloo", "--csv", csv.string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  const auto rows = read_csv(csv);
  ASSERT_EQ(rows.size(), 2u);
  ASSERT_EQ(rows[1].size(), rows[0].size()) << "a row's cells against the header's";
  EXPECT_EQ(rows[1][2], "cpu:shm,cuda:gloo");
  EXPECT_EQ(rows[1][3], "2");  // world size
  EXPECT_EQ(rows[1][6], "3");  // steps
  EXPECT_GT(std::stod(rows[1][7]), 0) << "samples/s";
}

// --fsdp: FullyShardedDataParallel instead of DDP; each of 2 ranks holds half the parameters,
// gradients and optimizer state (mlp-1024: 1.86 M float parameters, 7.455 MB each). ZeRO-2
// gathers the whole model at once; ZeRO-3 at most fc1 and fc2 (the one computing and the one
// prefetched).
TEST_F(BenchTest, TrainWithFsdpShardsWhatEachRankHolds) {
  for (const std::string strategy : {"zero2", "zero3"}) {
    Result r = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32",
                                     "--steps", "3", "--warmup", "1", "--fsdp", strategy}));
    ASSERT_TRUE(r.exited(0)) << r.describe();
    const bool z3 = strategy == "zero3";
    for (const std::string s :
         {"2 ranks x 1 thread (shm, " + strategy + ")",
          std::string("FullyShardedDataParallel (ZeRO-") + (z3 ? "3" : "2") + ") instead of DDP",
          std::string("optimizer state 3.727 MB on the fullest rank, 7.455 MB over 2 ranks "
                      "(FSDP, ZeRO-") +
              (z3 ? "3)" : "2)"),
          std::string("parameters and gradients 7.455 MB on the fullest rank between steps; "
                      "parameters whole at once at most ") +
              (z3 ? "7.414 MB" : "7.455 MB")}) {
      EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
    }
  }
  Result both = run_command(bench(1, {"train", "--steps", "1", "--fsdp", "zero2", "--zero"}));
  EXPECT_FALSE(both.exited(0)) << both.describe();
  EXPECT_NE(both.err.find("--fsdp shards parameters, gradients and optimizer state itself"),
            std::string::npos)
      << both.describe();
}

// DDPOptions from the command line: gradients as views into the buckets, a smaller cap.
TEST_F(BenchTest, TrainWithBucketViewsAndASmallerCap) {
  Result r = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32", "--steps",
                                   "2", "--warmup", "1", "--gradient-as-bucket-view",
                                   "--bucket-cap-mb", "2"}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("DDP buckets of 2 MB, gradients as bucket views"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("2 ranks x 1 thread"), std::string::npos) << r.out;
}

// --zero: the optimizer state sharded (Note [ZeRO-1]); mlp-1024's two large weights land on
// different ranks, so the fullest rank holds one of them (4.19 MB of momentum), not both.
TEST_F(BenchTest, TrainWithZeroShardsTheOptimizerState) {
  Result plain = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32",
                                       "--steps", "2", "--warmup", "1"}));
  ASSERT_TRUE(plain.exited(0)) << plain.describe();
  EXPECT_NE(plain.out.find("optimizer state 7.455 MB on the fullest rank, 14.910 MB over 2 ranks"),
            std::string::npos)
      << plain.out;
  // The bucket profile benchmarks/perf_model.py reads: mlp-1024's buckets after the rebuild
  // (fc3 and fc2, 1,059,850 values; fc1, 803,840), their launch times and the last gradient's.
  EXPECT_TRUE(std::regex_search(plain.out,
                                std::regex(": buckets 4239400,3215360 bytes; launched at "
                                           "[0-9.]+,[0-9.]+ ms; last gradient at [0-9.]+ ms")))
      << plain.out;
  Result zero = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32",
                                      "--steps", "2", "--warmup", "1", "--zero"}));
  ASSERT_TRUE(zero.exited(0)) << zero.describe();
  EXPECT_NE(zero.out.find("optimizer: ZeroRedundancyOptimizer(SGD)"), std::string::npos)
      << zero.out;
  EXPECT_NE(zero.out.find("optimizer state 4.194 MB on the fullest rank, 7.455 MB over 2 ranks "
                          "(ZeRO-1)"),
            std::string::npos)
      << zero.out;
  // --zero-overlap (Note [ZeRO overlapped with DDP]): whole DDP buckets are owned, fc3 and fc2
  // (4.239 MB) by rank 0, fc1 by rank 1; updates start at the third step.
  Result overlapped = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32",
                                            "--steps", "2", "--warmup", "1", "--zero-overlap"}));
  ASSERT_TRUE(overlapped.exited(0)) << overlapped.describe();
  EXPECT_NE(overlapped.out.find("optimizer: ZeroRedundancyOptimizer(SGD) stepped in DDP's hook"),
            std::string::npos)
      << overlapped.out;
  EXPECT_NE(overlapped.out.find("optimizer state 4.239 MB on the fullest rank, 7.455 MB over 2 "
                                "ranks (ZeRO-1)"),
            std::string::npos)
      << overlapped.out;
}

// --comm-hook powersgd:1 (Note [PowerSGD]) on mlp-1024: the three weight matrices go as rank-1
// factors, (1024 + 784) + (1024 + 1024) + (10 + 1024) values, the 2058 bias values as they are.
TEST_F(BenchTest, TrainWithPowerSGDSaysWhatItSends) {
  Result r = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32",
                                   "--steps", "2", "--warmup", "2", "--comm-hook", "powersgd:1"}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("comm hook powersgd:1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("PowerSGD rank 1 sends 268.2x fewer gradient values (6948 of 1863690 a "
                       "step)"),
            std::string::npos)
      << r.out;
  Result bad = run_command(bench(1, {"train", "--comm-hook", "powersgd:x"}));
  EXPECT_EQ(bad.exit_code, 2) << bad.describe();
  EXPECT_NE(bad.err.find("powersgd:RANK needs a whole number from 1 to 1024, not 'x'"),
            std::string::npos)
      << bad.describe();
}

TEST_F(BenchTest, TrainWithoutDdpIsTheCeiling) {
  const fs::path csv = dir_ / "n.csv";
  Result r = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32", "--steps",
                                   "3", "--warmup", "1", "--no-ddp", "--csv", csv.string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  const auto rows = read_csv(csv);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1][2], "no comm");
  EXPECT_EQ(rows[1][12], "0.0000") << "no exposed communication";
  Result both = run_command(bench(1, {"train", "--steps", "1", "--no-ddp", "--compare"}));
  EXPECT_FALSE(both.exited(0)) << both.describe();
}

// The lockstep ceiling: the ranks wait for each other once per step and move no gradient.
TEST_F(BenchTest, LockstepCeilingMeetsOncePerStepAndMovesNoGradient) {
  const fs::path csv = dir_ / "l.csv";
  Result r = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32", "--steps",
                                   "3", "--warmup", "1", "--no-ddp", "--lockstep", "--csv",
                                   csv.string()}));
  ASSERT_TRUE(r.exited(0)) << r.describe();
  EXPECT_NE(r.out.find("2 ranks x 1 thread (lockstep)"), std::string::npos) << r.out;
  const auto rows = read_csv(csv);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1][2], "lockstep");
  EXPECT_EQ(rows[1][12], "0.0000") << "no exposed communication";
  Result c = run_command(bench(2, {"train", "--model", "mlp-1024", "--batch-size", "32", "--steps",
                                   "2", "--warmup", "1", "--compare", "--lockstep"}));
  ASSERT_TRUE(c.exited(0)) << c.describe();
  EXPECT_NE(c.out.find("# the lockstep ceiling (the same, one barrier per step) is "),
            std::string::npos)
      << c.out;
  Result alone = run_command(bench(1, {"train", "--steps", "1", "--lockstep"}));
  EXPECT_TRUE(alone.exited(2)) << alone.describe();
  EXPECT_NE(alone.err.find("--lockstep is a ceiling: give it with --no-ddp"), std::string::npos)
      << alone.describe();
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

// Sizes no run could mean get one line and exit 2 before anything is allocated or started (a
// global batch above the training set used to loop forever: the loader drops short batches).
TEST_F(BenchTest, SizesPastTheMachineOrTheDataAreOneLine) {
  for (const auto& [args, needle] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"train", "--batch-size", "99999999", "--steps", "1"},
            "--batch-size 99999999 (global) is more than the training set's 60000 images; use "
            "at most 60000"},
           // CLI11's own words, which differ between versions after "range".
           {{"train", "--threads", "1000000"}, "--threads: Value 1000000 not in range"},
           {{"train", "--workers", "1000000"}, "--workers: Value 1000000 not in range"},
           {{"collectives", "--max-bytes", "1000G"},
            "--max-bytes 1000G: more than a quarter of this machine's memory"}}) {
    Result r = run_command(bench(1, args));
    EXPECT_TRUE(r.exited(2)) << r.describe();
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.describe();
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace ddp
