// ddprun's restart rounds (Note [Restart rounds] in tools/ddprun/rounds.h), nodes as threads in
// one process over a real agent store on 127.0.0.1: every node joins the same round, a failure
// reaches the others, a node whose ddprun starts again ends the round it had joined and everyone
// meets in the next, a missing node is named within the timeout, restarts are bounded, and node
// 0 keeps its store up until the others are done.
#include <atomic>
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "base/net.h"  // pick_free_port
#include "ddp/error.h"
#include "rounds.h"
#include "store/client.h"
#include "store/protocol.h"  // job_key

namespace ddp::launcher {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

const auto kNoStop = [] { return false; };

class RoundsTest : public ::testing::Test {
 protected:
  LaunchConfig node_config(int node_rank) const {
    LaunchConfig c;
    c.nnodes = 2;
    c.node_rank = node_rank;
    c.master_addr = "127.0.0.1";
    c.master_port = port_;
    c.max_restarts = 2;
    c.rdzv_timeout = Seconds(5);
    c.grace_period = Seconds(0.5);
    return c;
  }
  std::unique_ptr<Rounds> node(const LaunchConfig& c) {
    return make_rounds(c, EnvMap{}, "run-1", "secret");
  }
  // Polls `rounds` for another node's failure in `round`, up to `limit_s`.
  static std::optional<std::string> failure_within(Rounds& rounds, int round, double limit_s) {
    const auto start = Clock::now();
    while (seconds_since(start) < limit_s) {
      if (auto f = rounds.failure_elsewhere(round)) return f;
      std::this_thread::sleep_for(20ms);
    }
    return std::nullopt;
  }

  static int round_of(const std::optional<Membership>& m) { return m ? m->round : -1; }

  // Node 0 and node 1 join `round` together.
  static void both_join(Rounds& n0, Rounds& n1, int round) {
    auto joined1 = std::async(std::launch::async, [&] { return n1.join(round, kNoStop); });
    EXPECT_EQ(round_of(n0.join(round, kNoStop)), round);
    EXPECT_EQ(round_of(joined1.get()), round);
  }

  const int port_ = net::pick_free_port();
  const LaunchConfig c0_ = node_config(0), c1_ = node_config(1);
};

// Node 0's ddprun hosts the agent store by the same rules as rank 0 (Note [Hosting the store]):
// DDP_STORE_MAX_BYTES caps what it stores (the launcher's copy of the hosting code once ignored
// it), and a value that is not a size is refused, naming the variable.
TEST_F(RoundsTest, TheAgentStoreHonoursDdpStoreMaxBytes) {
  auto n0 = make_rounds(c0_, EnvMap{{"DDP_STORE_MAX_BYTES", "64K"}}, "run-1", "secret");
  store::ClientOptions o;
  o.host = "127.0.0.1";
  o.port = port_;
  o.key = store::job_key("secret", "run-1");
  o.who = "[test]";
  o.owner = "node 0";
  store::Client client(o);
  client.set("small", std::string(1024, 'x'), Clock::now() + 5s);
  try {
    client.set("big", std::string(100 * 1024, 'x'), Clock::now() + 5s);
    FAIL() << "the agent store stored past DDP_STORE_MAX_BYTES";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "limit of 65536 bytes")) << e.what();
  }
  try {
    make_rounds(node_config(0), EnvMap{{"DDP_STORE_MAX_BYTES", "lots"}}, "run-2", "secret");
    FAIL() << "accepted DDP_STORE_MAX_BYTES=lots";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "DDP_STORE_MAX_BYTES='lots' is not a size")) << e.what();
  }
}

TEST_F(RoundsTest, ASingleNodeRunsItsOwnAttempts) {
  LaunchConfig c;
  auto local = make_rounds(c, EnvMap{}, "run-1", "");
  EXPECT_FALSE(local->agent_store());
  EXPECT_EQ(round_of(local->join(3, kNoStop)), 3);
  EXPECT_EQ(local->failure_elsewhere(3), std::nullopt);
}

TEST_F(RoundsTest, EveryNodeJoinsTheRoundAndAFailureReachesTheOthers) {
  auto n0 = node(c0_);
  auto n1 = node(c1_);
  EXPECT_TRUE(n0->agent_store());
  both_join(*n0, *n1, 0);
  EXPECT_EQ(n0->failure_elsewhere(0), std::nullopt);

  EXPECT_EQ(n1->report_failure(0, "rank 3 failed (exit code 1)"), std::nullopt);  // the first
  const auto start = Clock::now();
  auto seen = failure_within(*n0, 0, 3.0);
  ASSERT_TRUE(seen.has_value());
  EXPECT_LT(seconds_since(start), 1.5) << "polled every kPollInterval";
  EXPECT_TRUE(contains(*seen, "node 1 (")) << *seen;
  EXPECT_TRUE(contains(*seen, "rank 3 failed (exit code 1)")) << *seen;
  // Node 0's own failure came second: it learns the first.
  auto first = n0->report_failure(0, "rank 0 failed (exit code 1)");
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(*first, *seen);

  both_join(*n0, *n1, 1);
}

TEST_F(RoundsTest, ANodeWhoseDdprunStartsAgainEndsItsRoundAndAllMeetInTheNext) {
  auto n0 = node(c0_);
  {
    auto n1 = node(c1_);
    both_join(*n0, *n1, 0);
  }  // node 1's ddprun is gone (killed with its workers), and started again: it remembers nothing
  auto n1_again = node(c1_);
  auto rejoined = std::async(std::launch::async, [&] { return n1_again->join(0, kNoStop); });
  auto seen = failure_within(*n0, 0, 3.0 + std::chrono::duration<double>(kAliveWindow).count());
  ASSERT_TRUE(seen.has_value()) << "node 0 was not told that round 0 is over";
  EXPECT_TRUE(contains(*seen, "node 1 (")) << *seen;
  EXPECT_TRUE(contains(*seen, "its ddprun started again")) << *seen;
  EXPECT_EQ(round_of(n0->join(1, kNoStop)), 1);
  EXPECT_EQ(round_of(rejoined.get()), 1);
}

// A second ddprun given a node rank that is running is refused, not taken for a restart.
TEST_F(RoundsTest, ASecondDdprunWithTheSameNodeRankIsRefused) {
  auto n0 = node(c0_);
  auto n1 = node(c1_);
  both_join(*n0, *n1, 0);
  std::atomic<bool> running{true};
  std::thread supervising([&] {  // node 1's ddprun watching its workers
    while (running) {
      n1->failure_elsewhere(0);
      std::this_thread::sleep_for(20ms);
    }
  });
  auto duplicate = node(c1_);
  try {
    duplicate->join(0, kNoStop);
    ADD_FAILURE() << "a second node 1 joined";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "two ddprun were given --node-rank 1")) << e.what();
  }
  running = false;
  supervising.join();
  EXPECT_EQ(n0->failure_elsewhere(0), std::nullopt) << "the running round was not ended";
}

TEST_F(RoundsTest, NodesOfAnotherShapeAreRefused) {
  LaunchConfig c = c0_;
  c.rdzv_timeout = Seconds(2);
  auto n0 = node(c);
  auto waiting = std::async(std::launch::async, [&] {
    try {
      n0->join(0, kNoStop);
    } catch (const RendezvousError&) {  // node 1 never joins
    }
  });
  std::this_thread::sleep_for(300ms);
  LaunchConfig three = c1_;
  three.nnodes = 3;
  auto n1 = node(three);
  try {
    n1->join(0, kNoStop);
    FAIL() << "joined with another --nnodes";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(),
                         "was started with --nnodes 3, --nproc-per-node 1, but this "
                         "job's first node with --nnodes 2, --nproc-per-node 1"))
        << e.what();
  }
  waiting.get();
}

TEST_F(RoundsTest, AMissingNodeIsNamedWithinTheTimeout) {
  LaunchConfig c = c0_;
  c.rdzv_timeout = Seconds(1);
  auto n0 = node(c);
  const auto start = Clock::now();
  try {
    n0->join(0, kNoStop);
    FAIL() << "joined without node 1";
  } catch (const RendezvousError& e) {
    EXPECT_TRUE(contains(e.what(), "1/2 nodes joined restart round 0")) << e.what();
    EXPECT_TRUE(contains(e.what(), "missing nodes: 1")) << e.what();
  }
  EXPECT_LT(seconds_since(start), 3.0);
}

TEST_F(RoundsTest, NoAgentStoreIsABoundedErrorNamingIt) {
  LaunchConfig c = c1_;
  c.rdzv_timeout = Seconds(1);
  auto n1 = node(c);
  const auto start = Clock::now();
  try {
    n1->join(0, kNoStop);
    FAIL() << "joined without a store";
  } catch (const RendezvousError& e) {
    EXPECT_TRUE(contains(e.what(), "node 1 (")) << e.what();
    EXPECT_TRUE(contains(e.what(), "could not reach the job's agent store at 127.0.0.1:" +
                                       std::to_string(port_)))
        << e.what();
    EXPECT_TRUE(contains(e.what(), "Node 0's ddprun hosts it")) << e.what();
  }
  EXPECT_LT(seconds_since(start), 4.0);
}

TEST_F(RoundsTest, AnotherJobsSecretIsRefusedAtOnce) {
  auto n0 = node(c0_);
  auto stranger = make_rounds(c1_, EnvMap{}, "run-1", "another secret");
  const auto start = Clock::now();
  try {
    stranger->join(0, kNoStop);
    FAIL() << "joined with another secret";
  } catch (const RendezvousError& e) {
    EXPECT_TRUE(contains(e.what(), "refused this process")) << e.what();
  }
  EXPECT_LT(seconds_since(start), 2.0) << "not retried until the timeout";
}

TEST_F(RoundsTest, ARoundPastMaxRestartsIsRefused) {
  LaunchConfig a = c0_, b = c1_;
  a.max_restarts = b.max_restarts = 0;
  auto n0 = node(a);
  auto n1 = node(b);
  both_join(*n0, *n1, 0);
  try {
    n1->join(1, kNoStop);
    FAIL() << "round 1 with --max-restarts 0";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "past --max-restarts 0")) << e.what();
  }
}

// Note [Final failures]: a final failure on one node is final on every node.
TEST_F(RoundsTest, AFinalFailureIsFinalEverywhere) {
  auto n0 = node(c0_);
  auto n1 = node(c1_);
  both_join(*n0, *n1, 0);
  EXPECT_FALSE(n0->final_failure(0));
  EXPECT_EQ(n1->report_failure(0, "rank 2 failed (exit code 2)", /*final=*/true), std::nullopt);
  EXPECT_TRUE(n0->final_failure(0));
  // A node that would restart anyway (started again) is told no node restarts.
  auto n1_again = node(c1_);
  try {
    n1_again->join(1, kNoStop);
    FAIL() << "joined round 1 after a final failure";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "restart round 0 ended with a final failure")) << e.what();
    EXPECT_TRUE(contains(e.what(), "rank 2 failed (exit code 2)")) << e.what();
  }
}

// A node whose workers all succeeded has left: a node that failed in the same round does not
// wait for it in the next one.
TEST_F(RoundsTest, NoRestartWithoutANodeThatFinished) {
  auto n0 = node(c0_);
  auto n1 = node(c1_);
  both_join(*n0, *n1, 0);
  n1->leave(0, /*failed=*/false);
  EXPECT_EQ(n0->report_failure(0, "rank 0 failed (exit code 1)"), std::nullopt);
  const auto start = Clock::now();
  try {
    n0->join(1, kNoStop);
    FAIL() << "waited for a node that finished";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "node 1 (")) << e.what();
    EXPECT_TRUE(contains(e.what(), "finished restart round 0 (its workers exited 0)")) << e.what();
  }
  EXPECT_LT(seconds_since(start), 1.0);
}

TEST_F(RoundsTest, ASignalEndsTheWaitForTheOthers) {
  auto n0 = node(c0_);
  const auto start = Clock::now();
  auto stop = [&] { return seconds_since(start) > 0.3; };
  EXPECT_FALSE(n0->join(0, stop).has_value());
  EXPECT_LT(seconds_since(start), 1.5);
}

TEST_F(RoundsTest, NodeZeroKeepsItsStoreUntilTheOthersAreDone) {
  auto n0 = node(c0_);
  auto n1 = node(c1_);
  both_join(*n0, *n1, 0);
  const auto start = Clock::now();
  auto left0 = std::async(std::launch::async, [&] {
    n0->leave(0, /*failed=*/false);
    return seconds_since(start);
  });
  std::this_thread::sleep_for(700ms);
  EXPECT_EQ(left0.wait_for(0s), std::future_status::timeout) << "node 0 left before node 1";
  n1->leave(0, false);
  const double took = left0.get();
  EXPECT_GT(took, 0.6);
  EXPECT_LT(took, 3.0);
}

// Ctrl-C while node 0 waits for the others to be done with its store ends the wait.
TEST_F(RoundsTest, ASignalEndsNodeZerosWaitForTheOthers) {
  auto n0 = node(c0_);
  auto n1 = node(c1_);
  both_join(*n0, *n1, 0);
  const auto start = Clock::now();
  n0->leave(0, /*failed=*/false, [&] { return seconds_since(start) > 0.3; });
  EXPECT_LT(seconds_since(start), 1.5) << "node 1 never leaves: only the signal ends the wait";
}

}  // namespace
}  // namespace ddp::launcher
