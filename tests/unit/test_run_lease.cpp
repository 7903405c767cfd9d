// The run folder's lease (Note [Run folder lease] in ddp/run_lease.h): who may take a folder, at
// once or after watching, who is refused and with what words, every wait bounded, and the
// Checkpointer refusing to publish a file once its group lost the folder. Holders are lease
// objects of this process (each its own holder) or lease files written as another host's.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "ddp/checkpoint.h"
#include "ddp/run_lease.h"
#include "test_checkpoint_support.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::TempDir;

constexpr RunLeaseOptions kShort{.ttl = milliseconds(400), .lock_timeout = milliseconds(300)};

std::string this_host() {
  char name[256] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? name : "unknown-host";
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The message of the FencedError `f` throws ("" when it throws nothing).
template <class F>
std::string fenced_message(F&& f) {
  try {
    f();
  } catch (const FencedError& e) {
    return e.what();
  }
  return "";
}

// A lease file as another process left it.
void write_lease(const fs::path& dir, const RunIdentity& who, const std::string& host, int pid,
                 int64_t renewed_ms_ago) {
  fs::create_directories(dir);
  const int64_t now =
      std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  std::ofstream(RunLease::lease_path(dir))
      << nlohmann::json{{"run_id", who.run_id},
                        {"lineage", who.lineage},
                        {"round", who.round},
                        {"host", host},
                        {"pid", pid},
                        {"pid_start", 0},
                        {"nonce", "0123456789abcdef"},
                        {"renewals", 0},
                        {"renewed_unix_ms", now - renewed_ms_ago},
                        {"ttl_ms", 400}}
             .dump();
}

// `second` claims a folder that `first` holds: why it was refused ("" if it was not), how long
// that took; `first` keeps the folder.
struct Refusal {
  std::string why;
  double seconds = 0;
};
Refusal refusal(const RunIdentity& first, const RunIdentity& second,
                RunLeaseOptions first_options = kShort, RunLeaseOptions second_options = kShort) {
  TempDir tmp;
  auto holder = RunLease::acquire(tmp.path(), first, first_options);
  const auto t = Clock::now();
  Refusal out;
  out.why = fenced_message([&] { RunLease::acquire(tmp.path(), second, second_options); });
  out.seconds = seconds_since(t);
  EXPECT_TRUE(holder->held()) << "the holder lost the folder to a refused claim";
  return out;
}

TEST(RunLease, AFreeFolderIsTakenAtOnceAndReleasedAtTheEnd) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "run";
  {
    auto a = RunLease::acquire(dir, {.run_id = "job", .lineage = "L1", .round = 0}, kShort);
    EXPECT_TRUE(a->held());
    EXPECT_NO_THROW(a->check("a metrics row"));
    const auto j = nlohmann::json::parse(read_text(RunLease::lease_path(dir)));
    EXPECT_EQ(j["run_id"], "job");
    EXPECT_EQ(j["lineage"], "L1");
    EXPECT_EQ(j["pid"], static_cast<int>(::getpid()));
    // Renewed while held.
    std::this_thread::sleep_for(milliseconds(350));
    EXPECT_GT(nlohmann::json::parse(read_text(RunLease::lease_path(dir)))["renewals"], 0);
  }
  EXPECT_FALSE(fs::exists(RunLease::lease_path(dir)));
  const std::string log = read_text(RunLease::log_path(dir));
  EXPECT_NE(log.find("take job 'job' (lineage L1, round 0)"), std::string::npos) << log;
  EXPECT_NE(log.find("a free folder"), std::string::npos) << log;
  EXPECT_NE(log.find("release job 'job'"), std::string::npos) << log;
  // The next one takes it at once.
  const auto t = Clock::now();
  auto b = RunLease::acquire(dir, {.run_id = "job", .lineage = "L2", .round = 0}, kShort);
  EXPECT_LT(seconds_since(t), 0.2);
}

TEST(RunLease, AnotherJobIsRefusedAtOnceAndTheHolderKeepsTheFolder) {
  const Refusal r =
      refusal({.run_id = "job-a", .lineage = "L1"}, {.run_id = "job-b", .lineage = "L2"});
  EXPECT_LT(r.seconds, 0.2);
  EXPECT_NE(r.why.find("job 'job-b' (lineage L2, round 0) cannot take it: the folder is in use by "
                       "another job: job 'job-a' (lineage L1, round 0), rank 0 on host"),
            std::string::npos)
      << r.why;
  EXPECT_NE(r.why.find("Give this job its own --output-dir, or stop the other job first"),
            std::string::npos)
      << r.why;
}

TEST(RunLease, ANewerRoundTakesAtOnceAndTheOldRoundIsFencedOut) {
  TempDir tmp;
  auto old_round =
      RunLease::acquire(tmp.path(), {.run_id = "j", .lineage = "L", .round = 1}, kShort);
  const auto t = Clock::now();
  auto new_round =
      RunLease::acquire(tmp.path(), {.run_id = "j", .lineage = "L", .round = 2}, kShort);
  EXPECT_LT(seconds_since(t), 0.2);
  EXPECT_FALSE(old_round->held());
  const std::string why = fenced_message([&] { old_round->check("a metrics.csv row"); });
  EXPECT_NE(why.find("a metrics.csv row refused: job 'j' (lineage L, round 1) no longer holds the "
                     "run folder"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("it is held by job 'j' (lineage L, round 2)"), std::string::npos) << why;
  // The old one's renewals and its release leave the new holder's lease alone.
  std::this_thread::sleep_for(milliseconds(250));
  old_round.reset();
  EXPECT_TRUE(new_round->held());
  EXPECT_NE(read_text(RunLease::log_path(tmp.path())).find("a newer round of the job takes over"),
            std::string::npos);
}

TEST(RunLease, AnOlderRoundIsRefusedAtOnce) {
  const Refusal r = refusal({.run_id = "j", .lineage = "L", .round = 3},
                            {.run_id = "j", .lineage = "L", .round = 2});
  EXPECT_LT(r.seconds, 0.2);
  EXPECT_NE(r.why.find("round 2 of this job is no longer current: job 'j' (lineage L, round 3)"),
            std::string::npos)
      << r.why;
}

// The same job with another lineage: a fresh store somewhere started a second instance of it.
// Its holder renews, so the newcomer is refused as soon as it sees a renewal.
TEST(RunLease, AnotherLineageIsRefusedWhileItsHolderRenews) {
  const Refusal r = refusal({.run_id = "j", .lineage = "L1", .round = 5},
                            {.run_id = "j", .lineage = "L2", .round = 9});
  EXPECT_LT(r.seconds, 0.4 * 2);
  EXPECT_NE(r.why.find("its holder is alive (it renewed while this one watched): job 'j' (lineage "
                       "L1, round 5)"),
            std::string::npos)
      << r.why;
}

// Two groups that both believe they are round 1 of the job (a divided job whose majority rule
// was broken): the second is refused as soon as it sees the first renew.
TEST(RunLease, TheSameRoundTwiceIsRefusedWhileItsHolderRenews) {
  const Refusal r = refusal({.run_id = "j", .lineage = "L", .round = 1},
                            {.run_id = "j", .lineage = "L", .round = 1});
  EXPECT_NE(r.why.find("its holder is alive (it renewed while this one watched)"),
            std::string::npos)
      << r.why;
}

// A holder with a longer ttl renews less often: the watch lasts its ttl, not the newcomer's.
TEST(RunLease, TheWatchLastsTheHoldersTtlWhenItIsLonger) {
  const Refusal r = refusal({.run_id = "j", .lineage = "L1"}, {.run_id = "j", .lineage = "L2"},
                            {.ttl = milliseconds(1200), .lock_timeout = milliseconds(300)},
                            {.ttl = milliseconds(100), .lock_timeout = milliseconds(300)});
  EXPECT_NE(r.why.find("its holder is alive (it renewed while this one watched)"),
            std::string::npos)
      << r.why;
}

// A holder on another host that stopped renewing (its host crashed): taken after a whole ttl of
// watching, whatever its clock said.
TEST(RunLease, ASilentHolderElsewhereIsTakenAfterTheTtl) {
  TempDir tmp;
  write_lease(tmp.path(), {.run_id = "j", .lineage = "L1", .round = 4}, "another-host", 4242, 0);
  const auto t = Clock::now();
  auto b = RunLease::acquire(tmp.path(), {.run_id = "j", .lineage = "L2", .round = 0}, kShort);
  EXPECT_GE(seconds_since(t), 0.4);
  EXPECT_LT(seconds_since(t), 0.4 * 4);
  EXPECT_NE(read_text(RunLease::log_path(tmp.path())).find("its holder did not renew for 0.4 s"),
            std::string::npos);
  // Another job's holder, silent for long: the same.
  TempDir tmp2;
  write_lease(tmp2.path(), {.run_id = "other"}, "another-host", 4242, 60'000);
  EXPECT_NO_THROW(RunLease::acquire(tmp2.path(), {.run_id = "j"}, kShort));
}

// A holder of this host whose process is gone: taken at once (a job killed and started again).
TEST(RunLease, AGoneHolderOnThisHostIsTakenAtOnce) {
  TempDir tmp;
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  write_lease(tmp.path(), {.run_id = "other-job"}, this_host(), child, 0);
  const auto t = Clock::now();
  auto b = RunLease::acquire(tmp.path(), {.run_id = "j"}, kShort);
  EXPECT_LT(seconds_since(t), 0.2);
  EXPECT_NE(read_text(RunLease::log_path(tmp.path())).find("its holder is gone"),
            std::string::npos);
}

TEST(RunLease, AnUnreadableLeaseIsReplaced) {
  TempDir tmp;
  std::ofstream(RunLease::lease_path(tmp.path())) << "{\"run_id\": \"j\", \"lin";
  auto b = RunLease::acquire(tmp.path(), {.run_id = "j"}, kShort);
  EXPECT_TRUE(b->held());
}

TEST(RunLease, ALockHeldForeverFailsInBoundedTimeNamingTheFile) {
  TempDir tmp;
  const int fd = ::open((tmp.path() / "run.lease.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // another open file description: flock excludes it
  const auto t = Clock::now();
  try {
    RunLease::acquire(tmp.path(), {.run_id = "j"}, kShort);
    ADD_FAILURE() << "acquired under a held lock";
  } catch (const FencedError&) {
    ADD_FAILURE() << "a lock timeout is not a refusal";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("run.lease.lock: another process held the run folder's "
                                         "lock for 300 ms"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(seconds_since(t), 2.0);
  ::close(fd);
}

TEST(RunLease, TheTtlComesFromTheEnvironment) {
  ::setenv("DDP_RUN_LEASE_TTL", "2.5", 1);
  EXPECT_EQ(default_run_lease_options().ttl, milliseconds(2500));
  ::setenv("DDP_RUN_LEASE_TTL", "soon", 1);
  EXPECT_THROW(default_run_lease_options(), ConfigError);
  ::unsetenv("DDP_RUN_LEASE_TTL");
  EXPECT_EQ(default_run_lease_options().ttl, milliseconds(10'000));
}

// A group that lost the folder publishes nothing more: no step file, last.ckpt unchanged, no
// temporary left behind.
TEST(RunLease, TheCheckpointerPublishesNothingOnceFencedOut) {
  TempDir tmp;
  const fs::path dir = tmp.path();
  auto mine = RunLease::acquire(dir, {.run_id = "j", .lineage = "L", .round = 1}, kShort);
  const Checkpointer c(dir / "checkpoints", {.lease = mine});
  testing::Net net;
  TrainingState state;
  state.add("model", net);
  c.save(state, {.step = 10, .epoch = 0});
  const std::string last_before = read_text(c.last_path());

  auto newer = RunLease::acquire(dir, {.run_id = "j", .lineage = "L", .round = 2}, kShort);
  const std::string why = fenced_message([&] { c.save(state, {.step = 20, .epoch = 0}); });
  EXPECT_NE(why.find("checkpoint epoch=0-step=20.ckpt refused: job 'j' (lineage L, round 1) no "
                     "longer holds the run folder"),
            std::string::npos)
      << why;
  EXPECT_FALSE(fs::exists(dir / "checkpoints" / "epoch=0-step=20.ckpt"));
  EXPECT_EQ(read_text(c.last_path()), last_before);
  EXPECT_TRUE(c.remove_stale_temp_files().empty());
  EXPECT_EQ(c.list().size(), 1u);
}

}  // namespace
}  // namespace ddp
