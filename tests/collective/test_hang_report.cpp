// Hang reports with ranks as threads (Gloo, or shm with DDP_TEST_BACKEND=shm): a skipped
// collective, a desync under DDP_DEBUG=detail, monitored_barrier, and DDP's bucket notes.
#include <sys/wait.h>  // waitpid
#include <unistd.h>    // fork, getpid, pause

#include <chrono>
#include <csignal>  // kill
#include <cstdlib>
#include <filesystem>
#include <latch>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp.h"
#include "process_group/hang_report.h"
#include "process_group/internal.h"
#include "process_group/shm_setup.h"  // host_identity
#include "store/c10d_store.h"
#include "store/server.h"
#include "support/ranks.h"

namespace ddp {
namespace {

using namespace std::chrono_literals;

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(HangReport, SkippedCollectiveNamesTheRankBehindAndWhereItStands) {
  const int port = testing::free_port();
  std::latch rank0_done(1);
  std::string message;
  double waited_s = 0;
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port, /*timeout=*/2s));
    set_training_step(812);
    for (int i = 0; i < 3; ++i) {
      auto t = torch::ones({4});
      pg->all_reduce(t).wait();
    }
    if (r == 1) {  // skips all_reduce #4 and stays in user code
      rank0_done.wait();
      return;
    }
    auto t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->all_reduce(t).wait();
    } catch (const TimeoutError& e) {
      message = e.what();
    }
    waited_s = seconds_since(start);
    rank0_done.count_down();
  });
  EXPECT_FALSE(errors[0]) << testing::message_of(errors[0]);
  EXPECT_FALSE(errors[1]) << testing::message_of(errors[1]);
  EXPECT_EQ(first_line(message),
            "[rank 0] all_reduce #4 timed out: rank 1 never issued all_reduce #4; its last "
            "completed collective is #3 (all_reduce) at step 812")
      << message;
  EXPECT_NE(message.find("rank 1: last issued all_reduce #3 (sum, 4 x Float) (completed)"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("frame #"), std::string::npos) << "no C++ backtrace: " << message;
  EXPECT_LT(waited_s, 2.0 + kAnswerDeadline.count() + 3.0);
}

// The store's host gone (rank 0 exited, the network down): no peer can be asked, and the report
// says so once, in its verdict, instead of repeating the store's error for every rank.
TEST(HangReport, AStoreThatIsGoneIsNamedOnceNotOncePerRank) {
  store::ServerOptions so;
  so.bind_addresses = {"127.0.0.1"};
  so.key = store::job_key("secret", "run");
  auto server = std::make_unique<store::Server>(so);
  store::ClientOptions co;
  co.host = "127.0.0.1";
  co.port = server->port();
  co.key = so.key;
  co.who = "[rank 0]";
  co.owner = "rank 0";
  auto client = c10::make_intrusive<store::DdpStore>(co, 1s);
  auto ring = std::make_shared<flight::Ring>(16);
  ring->issue({.op = Collective::kAllReduce, .dtype = DType::kF32, .count = 4, .seq = 1}, nullptr);
  ring->finish(1, false);
  HangReporter reporter(client, ring, {.rank = 0, .size = 3, .group = "default", .dump_dir = ""});
  server.reset();  // the store's host is gone
  const HangReporter::Report report = reporter.explain(1);
  EXPECT_EQ(report.verdict.rfind("no peer could be asked for its records (ranks 1, 2): the "
                                 "rendezvous store did not answer",
                                 0),
            0u)
      << report.verdict;
  EXPECT_NE(report.details.find("rank 1: no records (could not be asked: the store did not "
                                "answer)\n  rank 2: no records (could not be asked: the store "
                                "did not answer)\n  (the store: [rank 0]"),
            std::string::npos)
      << report.details;
  size_t mentions = 0;
  for (size_t at = 0; (at = report.details.find("127.0.0.1:", at)) != std::string::npos; ++at) {
    ++mentions;
  }
  EXPECT_EQ(mentions, 1u) << "the store's error once:\n" << report.details;
}

// A store of this process for a reporter built by hand: a server, and clients of it.
struct LocalStore {
  LocalStore() {
    store::ServerOptions so;
    so.bind_addresses = {"127.0.0.1"};
    so.key = store::job_key("secret", "run");
    server = std::make_unique<store::Server>(so);
  }
  c10::intrusive_ptr<store::DdpStore> client(const std::string& who) const {
    store::ClientOptions co;
    co.host = "127.0.0.1";
    co.port = server->port();
    co.key = store::job_key("secret", "run");
    co.who = who;
    co.owner = who;
    return c10::make_intrusive<store::DdpStore>(co, 2s);
  }
  std::unique_ptr<store::Server> server;
};

// A pid that no process has any more: a child that exited and was reaped.
int gone_pid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  return child;
}

// A peer whose "who" record reaches the store after the reporter's first look (it formed its
// group late) is still looked up on a later check.
TEST(HangReport, APeerRecordedAfterTheFirstLookIsCheckedLater) {
  LocalStore store;
  HangReporter reporter(store.client("[rank 0]"), std::make_shared<flight::Ring>(16),
                        {.rank = 0, .size = 2, .group = "default", .dump_dir = ""});
  EXPECT_EQ(reporter.check_local_peers(), "");  // rank 1 is not known yet
  const int pid = gone_pid();
  store.client("[rank 1]")->set("who/1", bytes(fmt::format("{} 1 {}", pid, host_identity())));
  EXPECT_EQ(reporter.check_local_peers(), fmt::format("rank 1 (pid {}) has exited", pid));
}

// A peer's pid reused by another process: the peer's record names its pid and start time, and
// the process now holding that pid started at another time, so the peer has exited.
TEST(HangReport, APeerWhosePidWasReusedIsReportedExited) {
  LocalStore store;
  HangReporter reporter(store.client("[rank 0]"), std::make_shared<flight::Ring>(16),
                        {.rank = 0, .size = 2, .group = "default", .dump_dir = ""});
  const pid_t other = fork();  // alive, and not the peer
  if (other == 0) {
    pause();
    _exit(0);
  }
  // Start time 1: one clock tick after boot, not when `other` started.
  store.client("[rank 1]")->set("who/1", bytes(fmt::format("{} 1 {}", other, host_identity())));
  EXPECT_EQ(reporter.check_local_peers(), fmt::format("rank 1 (pid {}) has exited", other));
  kill(other, SIGKILL);
  waitpid(other, nullptr, 0);
}

// The details name the dump files as publish() writes them, for a group that is not "default"
// too: flight_recorder_<group>_rank<R>.json.
TEST(HangReport, TheDetailsNameTheDumpFilesOfANamedGroup) {
  LocalStore store;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("ddp_hang_report_dump_{}", getpid());
  std::filesystem::create_directories(dir);
  auto ring = std::make_shared<flight::Ring>(16);
  ring->issue({.op = Collective::kAllReduce, .dtype = DType::kF32, .count = 4, .seq = 1}, nullptr);
  ring->finish(1, false);
  HangReporter reporter(store.client("[rank 0]"), ring,
                        {.rank = 0, .size = 1, .group = "sub", .dump_dir = dir.string()});
  const std::string details = reporter.explain(1).details;
  const std::string prefix = "each rank's records: ";
  const size_t at = details.find(prefix);
  ASSERT_NE(at, std::string::npos) << details;
  const size_t from = at + prefix.size();
  std::string name = details.substr(from, details.find(' ', from) - from);
  EXPECT_EQ(name, "flight_recorder_sub_rank<R>.json") << details;
  name.replace(name.find("<R>"), 3, "0");
  EXPECT_TRUE(std::filesystem::exists(dir / name)) << dir / name << " was not written";
  std::filesystem::remove_all(dir);
}

// A rank leaving its group says so in the store first (HangReporter::depart); when the store's
// host has already gone (rank 0 exited first, as at many a job's end) that must not hold the
// rank's exit up (the closed connection fails at once; a silent host is cut off at
// kDepartLimit).
TEST(HangReport, LeavingAfterTheStoreHostIsBoundedByTheDepartLimit) {
  const int port = testing::free_port();
  std::shared_ptr<ProcessGroup> groups[2];
  auto errors = testing::run_threads(2, [&](int r) {
    auto o = testing::thread_rank(r, 2, port);
    o.backend = "gloo";  // shm ranks learn of a departure from the shared segment instead
    groups[r] = make_process_group(o);
    auto t = torch::ones({4});
    groups[r]->all_reduce(t).wait();
  });
  ASSERT_FALSE(errors[0]) << testing::message_of(errors[0]);
  ASSERT_FALSE(errors[1]) << testing::message_of(errors[1]);
  groups[0].reset();  // rank 0, and the store it hosts, leave first
  const auto start = std::chrono::steady_clock::now();
  groups[1].reset();
  const double took = seconds_since(start);
  EXPECT_LT(took, std::chrono::duration<double>(kDepartLimit).count() + 0.5) << took << " s";
}

TEST(HangReport, DesyncUnderDebugDetailNamesBothCalls) {
  setenv("DDP_DEBUG", "detail", 1);
  const int port = testing::free_port();
  std::vector<std::string> messages(2);
  std::latch both_failed(2);
  double waited_s = 0;
  const auto start = std::chrono::steady_clock::now();
  auto errors = testing::run_threads(2, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 2, port, /*timeout=*/20s));
    auto warm = torch::ones({2});
    pg->all_reduce(warm).wait();  // #1 alike
    try {
      if (r == 0) {
        auto t = torch::ones({4});
        pg->all_reduce(t).wait();
      } else {
        auto t = torch::zeros({1}, torch::kLong);
        pg->broadcast(t, 0).wait();
      }
    } catch (const CollectiveError& e) {
      messages[r] = e.what();
    }
    both_failed.arrive_and_wait();  // rank 0 hosts the store: it stays until rank 1 is done
  });
  waited_s = seconds_since(start);
  unsetenv("DDP_DEBUG");
  EXPECT_FALSE(errors[0]) << testing::message_of(errors[0]);
  EXPECT_FALSE(errors[1]) << testing::message_of(errors[1]);
  for (int r = 0; r < 2; ++r) {
    const std::string head = first_line(messages[r]);
    EXPECT_NE(head.find(fmt::format("[rank {}]", r)), std::string::npos) << messages[r];
    EXPECT_NE(head.find("all_reduce #2 (sum, 4 x Float)"), std::string::npos) << messages[r];
    EXPECT_NE(head.find("broadcast #2 (from rank 0, 1 x Long)"), std::string::npos) << messages[r];
  }
  EXPECT_LT(waited_s, 15.0) << "a desync is found at once, not at the 20 s timeout";
}

TEST(HangReport, MonitoredBarrierNamesTheRanksThatDidNotArrive) {
  const int port = testing::free_port();
  std::vector<std::string> messages(3);
  std::latch done(2);
  std::latch finished(3);
  auto errors = testing::run_threads(3, [&](int r) {
    auto pg = make_process_group(testing::thread_rank(r, 3, port, /*timeout=*/30s));
    pg->monitored_barrier(5s);  // everyone arrives
    if (r == 2) {
      done.wait();  // never calls the second one
      finished.arrive_and_wait();
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->monitored_barrier(1s);
    } catch (const Error& e) {
      messages[r] = e.what();
    }
    EXPECT_LT(seconds_since(start), 4.0);
    done.count_down();
    finished.arrive_and_wait();  // rank 0 hosts the store: it stays until the others are done
  });
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(errors[r]) << testing::message_of(errors[r]);
  EXPECT_EQ(first_line(messages[0]),
            "[rank 0] monitored_barrier #2: rank 2 did not arrive within 1.0 s (2 of 3 ranks "
            "arrived)");
  EXPECT_EQ(first_line(messages[1]),
            "[rank 1] monitored_barrier #2 failed on rank 0: rank 2 did not arrive within 1.0 s "
            "(2 of 3 ranks arrived)");
}

TEST(HangReport, DdpBucketsAreRecordedWithTheirParametersAndStep) {
  testing::run_ranks(2, [](ProcessGroup& pg) {
    torch::manual_seed(0);
    auto net =
        torch::nn::Sequential(torch::nn::Linear(8, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
    std::shared_ptr<ProcessGroup> shared(&pg, [](ProcessGroup*) {});
    DistributedDataParallel model(net.ptr(), {.process_group = shared});
    set_training_step(7);
    model(torch::randn({3, 8})).sum().backward();
    ASSERT_TRUE(detail::impl_of(pg).recorder);
    bool bucket_seen = false;
    for (const flight::Record& rec : detail::impl_of(pg).recorder->snapshot()) {
      EXPECT_EQ(rec.state, flight::State::kCompleted) << rec.describe();
      if (rec.bucket < 0) continue;
      bucket_seen = true;
      EXPECT_EQ(rec.call.op, Collective::kAllReduce);
      EXPECT_EQ(rec.step, 7);
      EXPECT_EQ(rec.params.rfind("2.", 0), 0u) << rec.params;  // the last layer's come first
    }
    EXPECT_TRUE(bucket_seen);
  });
}

}  // namespace
}  // namespace ddp
