// Hang reports in real processes under ddprun, over Gloo: a SIGSTOPped rank is named long
// before the collective timeout, a skipped collective's verdict opens ddprun's summary, and each
// rank's flight recorder is dumped as JSON in its log folder.
#include <signal.h>  // kill

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;

const std::string kDdprun = testing::env_or_die("DDPRUN");
const std::string kWorker = testing::env_or_die("HANG_TEST_WORKER");

class TempDir {
 public:
  TempDir() { path_ = ddp::testing::make_temp_dir("ddp_hang"); }
  ~TempDir() { fs::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The dump a rank wrote under `dir`, parsed; null when there is none.
nlohmann::json find_dump(const std::string& dir, int rank) {
  const std::string name = "flight_recorder_rank" + std::to_string(rank) + ".json";
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.path().filename() == name) {
      std::ifstream in(e.path());
      return nlohmann::json::parse(in);
    }
  }
  return nullptr;
}

TEST(HangMultiproc, StoppedRankIsNamedLongBeforeTheTimeout) {
  TempDir logs;
  auto job = testing::Subprocess::start(
      {.argv = {kDdprun, "--standalone", "--nproc-per-node", "2", "--log-dir", logs.path(), "--tee",
                "3", kWorker, "loop"},
       .env = {{"DDP_BACKEND", "gloo"}, {"DDP_COLLECTIVE_TIMEOUT", "60"}},
       .timeout_s = 90});
  std::smatch m;
  const std::regex ready(R"(ready pid=(\d+))");
  ASSERT_TRUE(testing::wait_until(
      [&] {
        const std::string out = job.out_so_far();
        return std::regex_search(out, m, ready);
      },
      30))
      << job.err_so_far();
  const std::string out = job.out_so_far();
  std::regex_search(out, m, ready);
  const int pid = std::stoi(m[1]);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  const auto stopped_at = std::chrono::steady_clock::now();
  const std::string needle = "rank 1 (pid " + std::to_string(pid) + ") is stopped (SIGSTOP";
  const bool named =
      testing::wait_until([&] { return job.err_so_far().find(needle) != std::string::npos; }, 40);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped_at).count();
  ::kill(pid, SIGCONT);  // so that ddprun's SIGTERM ends it
  const testing::Result& r = job.wait();
  ASSERT_TRUE(named) << r.describe();
  EXPECT_LT(took, 15.0) << "the collective timeout is 60 s";
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  // The verdict opens rank 0's error: the first line of the root cause ddprun prints.
  EXPECT_NE(r.err.find("[rank 0] all_reduce #"), std::string::npos) << r.describe();
  EXPECT_EQ(r.err.find("frame #"), std::string::npos) << "no C++ backtraces: " << r.describe();

  const nlohmann::json dump = find_dump(logs.path(), 0);
  ASSERT_FALSE(dump.is_null()) << "no flight_recorder_rank0.json under " << logs.path();
  EXPECT_EQ(dump.at("rank"), 0);
  EXPECT_NE(dump.at("verdict").get<std::string>().find("is stopped"), std::string::npos)
      << dump.dump(1);
  ASSERT_TRUE(dump.at("records").is_array());
  ASSERT_FALSE(dump.at("records").empty());
  const nlohmann::json& last = dump.at("records").back();
  EXPECT_EQ(last.at("op"), "all_reduce");
  EXPECT_EQ(last.at("dtype"), "Float");
  EXPECT_EQ(last.at("count"), 4);
  EXPECT_GT(last.at("step").get<int64_t>(), 3);
}

TEST(HangMultiproc, SkippedCollectiveVerdictOpensTheSummary) {
  TempDir logs;
  const testing::Result r =
      testing::run_command({.argv = {kDdprun, "--standalone", "--nproc-per-node", "2", "--log-dir",
                                     logs.path(), kWorker, "skip"},
                            .env = {{"DDP_BACKEND", "gloo"}, {"DDP_COLLECTIVE_TIMEOUT", "3"}},
                            .timeout_s = 60});
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  const std::string verdict =
      "[rank 0] all_reduce #5 timed out: rank 1 never issued all_reduce #5; its last completed "
      "collective is #4 (all_reduce) at step 4";
  EXPECT_NE(r.err.find(verdict), std::string::npos) << r.describe();
  EXPECT_LT(r.wall_s, 30.0) << r.describe();
  const nlohmann::json dump = find_dump(logs.path(), 0);
  ASSERT_FALSE(dump.is_null());
  EXPECT_EQ(dump.at("records").size(), 5u);
}

}  // namespace
}  // namespace ddp
