// ddprun's elastic rounds (Note [Elastic rounds] in tools/ddprun/elastic.h), nodes as threads in
// one process over a real agent store on 127.0.0.1 (the first node hosts it): a round closes at
// MAX at once, the first at MIN after the last call, one after a loss once the live nodes are
// in, and never without a majority of the last round; node ranks stay where their nodes stay; a node
// over MAX waits, a waiting node below MAX re-forms the job, a leaving node re-forms it without
// a failure; failures (not re-formings) count against --max-restarts; fewer than MIN fail naming
// the missing; the job ending while a node waits ends that node's wait.
#include <algorithm>
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "base/net.h"  // pick_free_port
#include "ddp/error.h"
#include "elastic.h"
#include "support/rounds.h"  // all_join

namespace ddp::launcher {
namespace {

using ddp::testing::all_join;

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

const auto kNoStop = [] { return false; };

class ElasticRoundsTest : public ::testing::Test {
 protected:
  LaunchConfig config(int min_nodes, int max_nodes) const {
    LaunchConfig c;
    c.elastic = true;
    c.min_nodes = min_nodes;
    c.nnodes = max_nodes;
    c.master_addr = "127.0.0.1";
    c.master_port = port_;
    c.max_restarts = 1;
    c.rdzv_timeout = Seconds(4);
    c.last_call_timeout = Seconds(0.5);
    c.grace_period = Seconds(0.2);
    return c;
  }
  std::unique_ptr<Rounds> node(const LaunchConfig& c) {
    return make_rounds(c, EnvMap{}, "elastic-run", "secret");
  }
  // What `n` joining round `next` fails with ("joined" if it does not fail).
  static std::string join_error(Rounds& n, int next) {
    try {
      n.join(next, kNoStop);
      return "joined";
    } catch (const RendezvousError& e) {
      return e.what();
    }
  }
  // Polls `n` for a re-forming of `round`, up to `limit_s`.
  static std::optional<std::string> regroup_within(Rounds& n, int round, double limit_s) {
    const auto start = Clock::now();
    while (seconds_since(start) < limit_s) {
      if (auto why = n.regroup(round, false)) return why;
      std::this_thread::sleep_for(20ms);
    }
    return std::nullopt;
  }

  const int port_ = net::pick_free_port();
};

TEST_F(ElasticRoundsTest, ARoundClosesAtMaxAtOnceTheFirstAtMinAfterTheLastCall) {
  LaunchConfig c = config(2, 3);
  auto a = node(c), b = node(c), x = node(c);
  const auto start = Clock::now();
  auto full = all_join({a.get(), b.get(), x.get()}, 0);
  EXPECT_LT(seconds_since(start), 0.45) << "MAX nodes: no last call";
  for (const Membership& m : full) {
    EXPECT_EQ(m.round, 0);
    EXPECT_EQ(m.nnodes, 3);
  }
  // Node ranks 0, 1, 2, one each.
  std::vector<int> ranks;
  for (const Membership& m : full) ranks.push_back(m.node_rank);
  std::ranges::sort(ranks);
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 2}));
  // One instance of the job: every node's workers get the store's lineage.
  EXPECT_EQ(full[0].lineage.size(), 16u) << full[0].lineage;
  EXPECT_EQ(full[1].lineage, full[0].lineage);
  EXPECT_EQ(full[2].lineage, full[0].lineage);

  // Two of them re-form without the third (it left): every node of the last round that stays is
  // in, so the round closes without the last call (nobody new is on the way).
  ASSERT_TRUE(x->announce_leaving(0, "its ddprun received SIGTERM"));
  auto why = regroup_within(*a, 0, 2.0);
  ASSERT_TRUE(why.has_value());
  EXPECT_TRUE(contains(*why, "leaves: its ddprun received SIGTERM")) << *why;
  const auto again = Clock::now();
  auto two = all_join({a.get(), b.get()}, 1);
  EXPECT_LT(seconds_since(again), 0.45) << "after a leave: no last call";
  EXPECT_EQ(two[0].round, 1);
  EXPECT_EQ(two[0].nnodes, 2);
  EXPECT_EQ(two[0].restarts, 0) << "leaving is not a failure";
  EXPECT_EQ(two[0].lineage, full[0].lineage) << "a re-formed job is the same instance";
  EXPECT_EQ(two[1].lineage, full[0].lineage);
  // Ranks follow the previous round's order: the lower of a and b is 0 again.
  EXPECT_EQ(two[0].node_rank, full[0].node_rank < full[1].node_rank ? 0 : 1);
  EXPECT_EQ(two[1].node_rank, 1 - two[0].node_rank);
}

TEST_F(ElasticRoundsTest, TheJobsFirstRoundBelowMaxWaitsTheLastCall) {
  LaunchConfig c = config(2, 3);
  c.last_call_timeout = Seconds(1.0);
  auto a = node(c), b = node(c);
  const auto start = Clock::now();
  auto two = all_join({a.get(), b.get()}, 0);
  EXPECT_GE(seconds_since(start), 0.95) << "nodes may still be starting: the last call";
  EXPECT_EQ(two[0].nnodes, 2);
}

// A node of the last round that is slow to come (stopping its workers with a checkpoint) is
// waited for past the last call while its ddprun shows signs of life; a dead one for kDeadAfter.
TEST_F(ElasticRoundsTest, TheNextRoundWaitsForLiveNodesOfTheLastOneNotForDeadOnes) {
  const LaunchConfig c = config(1, 4);
  auto a = node(c), b = node(c), y = node(c), x = node(c);
  all_join({a.get(), b.get(), y.get(), x.get()}, 0);
  ASSERT_TRUE(x->announce_leaving(0, "its ddprun received SIGTERM"));
  const auto start = Clock::now();
  auto a_joins = std::async(std::launch::async, [&] { return a->join(1, kNoStop); });
  auto y_joins = std::async(std::launch::async, [&] { return y->join(1, kNoStop); });
  Clock::time_point last_beat;
  while (seconds_since(start) < 1.5) {  // b's ddprun is busy stopping its workers, alive
    last_beat = Clock::now();
    b->failure_elsewhere(0);
    std::this_thread::sleep_for(50ms);
  }
  std::optional<Membership> mb = b->join(1, kNoStop);
  std::optional<Membership> ma = a_joins.get();
  std::optional<Membership> my = y_joins.get();
  ASSERT_TRUE(ma && mb && my);
  EXPECT_EQ(ma->nnodes, 3) << "b was waited for, past the 0.5 s last call";
  EXPECT_EQ(mb->nnodes, 3);
  EXPECT_GE(seconds_since(start), 1.5);

  // b dies (no more signs of life); a's and y's next round waits kDeadAfter for it, then goes
  // on with 2 of the 3. kDeadAfter counts from b's last sign of life (its last beat), which is
  // before `again` by however long the lines between took (seconds under a sanitizer).
  EXPECT_EQ(a->report_failure(1, "rank 2 failed (exit code 1)", false), std::nullopt);
  b.reset();
  const auto again = Clock::now();
  auto two = all_join({a.get(), y.get()}, 2);
  EXPECT_EQ(two[0].nnodes, 2);
  const double dead_after = std::chrono::duration<double>(kDeadAfter).count();
  EXPECT_GE(seconds_since(last_beat), dead_after - 0.05) << "b was given up on before kDeadAfter";
  EXPECT_LT(seconds_since(again), dead_after + 2.0);
}

// After a node's death the round closes once the live nodes are in: kDeadAfter, not the last
// call (torchrun's default, 30 s, is what a loss cost before).
TEST_F(ElasticRoundsTest, AfterALossTheRoundClosesWithoutWaitingTheLastCall) {
  LaunchConfig c = config(1, 3);
  c.last_call_timeout = Seconds(30);
  c.rdzv_timeout = Seconds(60);
  auto a = node(c), b = node(c), x = node(c);
  all_join({a.get(), b.get(), x.get()}, 0);  // MAX: no last call
  EXPECT_EQ(a->report_failure(0, "rank 4 failed (exit code 1)", false), std::nullopt);
  x.reset();
  const auto start = Clock::now();
  auto two = all_join({a.get(), b.get()}, 1);
  EXPECT_EQ(two[0].nnodes, 2);
  EXPECT_LT(seconds_since(start), std::chrono::duration<double>(kDeadAfter).count() + 2.0);
}

// Note [Never two groups]: nodes that are not a majority of the last round (the others are cut
// off, or dead: a node cannot tell) wait, and fail at the join timeout naming what they lack.
TEST_F(ElasticRoundsTest, NodesWithoutAMajorityOfTheLastRoundNeverBeginOne) {
  const LaunchConfig c = config(1, 3);  // join timeout 4 s
  auto a = node(c), b = node(c), x = node(c);
  all_join({a.get(), b.get(), x.get()}, 0);
  EXPECT_EQ(a->report_failure(0, "rank 2 failed (exit code 1)", false), std::nullopt);
  b.reset();
  x.reset();
  const auto start = Clock::now();
  const std::string what = join_error(*a, 1);
  EXPECT_GE(seconds_since(start), 3.9) << "the join timeout (4 s)";
  EXPECT_TRUE(contains(what, "elastic round 1 could not begin")) << what;
  EXPECT_TRUE(contains(what, "its nodes hold 1 of the 3 node(s) of elastic round 0")) << what;
  EXPECT_TRUE(contains(what, "needs a majority of them (2)")) << what;
  EXPECT_TRUE(contains(what, "missing: ")) << what;
}

// The trap Raft's joint consensus avoids: a node of an old round, with newcomers, is counted
// against the newest round anyone knows (here the store's), not against its own.
TEST_F(ElasticRoundsTest, ANodeOfAnOldRoundAndNewcomersAreCountedAgainstTheNewestRound) {
  LaunchConfig c = config(1, 3);
  c.max_restarts = 5;
  auto a = node(c), b = node(c), x = node(c);
  all_join({a.get(), b.get(), x.get()}, 0);  // round 0: a, b, x
  // a is cut off (silent); b and x go on with a newcomer d: 2 of round 0's 3.
  EXPECT_EQ(b->report_failure(0, "rank 0 failed (exit code 1)", false), std::nullopt);
  auto d = node(c);
  auto second = all_join({b.get(), x.get(), d.get()}, 1);
  EXPECT_EQ(second[0].nnodes, 3);
  // Round 1 (b, x, d) ends and its nodes vanish; a comes back with two newcomers. a holds 1 of
  // round 0's 3 nodes, but round 1 is newer: the three hold none of its nodes.
  EXPECT_EQ(b->report_failure(1, "rank 1 failed (exit code 1)", false), std::nullopt);
  b.reset();
  x.reset();
  d.reset();
  auto e = node(c), f = node(c);
  std::vector<std::future<std::string>> verdicts;
  for (Rounds* n : {a.get(), e.get(), f.get()}) {
    verdicts.push_back(std::async(std::launch::async, [n] { return join_error(*n, 1); }));
  }
  for (auto& v : verdicts) {
    const std::string what = v.get();
    EXPECT_TRUE(contains(what, "its nodes hold 0 of the 3 node(s) of elastic round 1")) << what;
  }
}

TEST_F(ElasticRoundsTest, ANewcomerWaitsReFormsTheJobBelowMaxAndRanksLast) {
  const LaunchConfig c = config(1, 3);
  auto a = node(c), b = node(c);
  auto first = all_join({a.get(), b.get()}, 0);
  EXPECT_EQ(first[0].nnodes, 2);
  EXPECT_EQ(a->regroup(0, true), std::nullopt);
  // A third node arrives while round 0 runs: it waits, and the others see why they re-form.
  auto late = node(c);
  auto waiting = std::async(std::launch::async, [&] { return late->join(0, kNoStop); });
  auto why = regroup_within(*a, 0, 3.0);
  ASSERT_TRUE(why.has_value());
  EXPECT_TRUE(contains(*why, "waits to join; the job runs on 2 of at most 3 nodes")) << *why;
  EXPECT_EQ(b->regroup(0, true), why) << "every node reads the same reason";
  auto both = all_join({a.get(), b.get()}, 1);
  std::optional<Membership> third = waiting.get();
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->round, 1);
  EXPECT_EQ(third->nnodes, 3);
  EXPECT_EQ(third->node_rank, 2) << "a newcomer ranks after the nodes that stay";
  EXPECT_EQ(both[0].node_rank, first[0].node_rank);
  EXPECT_EQ(both[1].node_rank, first[1].node_rank);
}

TEST_F(ElasticRoundsTest, ANodeOverMaxWaitsUntilTheJobFinishes) {
  const LaunchConfig c = config(1, 2);
  auto a = node(c), b = node(c);
  all_join({a.get(), b.get()}, 0);
  auto extra = node(c);
  auto waiting = std::async(std::launch::async, [&] { return extra->join(0, kNoStop); });
  std::this_thread::sleep_for(1500ms);
  EXPECT_EQ(a->regroup(0, true), std::nullopt) << "at MAX: nobody re-forms for a waiting node";
  EXPECT_EQ(waiting.wait_for(0s), std::future_status::timeout) << "it still waits";
  // The job finishes: the waiting node's join ends, as a success.
  auto b_leaves = std::async(std::launch::async, [&] { b->leave(0, false, kNoStop); });
  a->leave(0, false, kNoStop);
  b_leaves.get();
  try {
    waiting.get();
    ADD_FAILURE() << "join returned";
  } catch (const JobEnded& e) {
    EXPECT_TRUE(e.succeeded);
    EXPECT_TRUE(contains(e.what(), "finished in round 0")) << e.what();
  }
}

TEST_F(ElasticRoundsTest, FailuresCountAgainstMaxRestarts) {
  const LaunchConfig c = config(2, 2);  // max_restarts 1
  auto a = node(c), b = node(c);
  all_join({a.get(), b.get()}, 0);
  EXPECT_EQ(a->report_failure(0, "rank 1 failed (exit code 1)", false), std::nullopt);
  auto second = all_join({a.get(), b.get()}, 1);
  EXPECT_EQ(second[0].restarts, 1) << "one failure so far";
  // A second failure is past --max-restarts 1: no node starts again.
  EXPECT_EQ(b->report_failure(1, "rank 3 failed (exit code 1)", false), std::nullopt);
  try {
    a->join(2, kNoStop);
    ADD_FAILURE() << "joined past --max-restarts";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "failed 2 time(s), past --max-restarts 1")) << e.what();
  }
}

TEST_F(ElasticRoundsTest, FewerThanMinFailAfterTheJoinTimeoutNamingTheMissing) {
  LaunchConfig c = config(2, 3);
  c.max_restarts = 3;
  auto a = node(c), b = node(c);
  auto first = all_join({a.get(), b.get()}, 0);
  EXPECT_EQ(a->report_failure(0, "rank 2 failed (exit code 1)", false), std::nullopt);
  b.reset();  // node b is gone with its host
  const auto start = Clock::now();
  const std::string what = join_error(*a, 1);
  EXPECT_GE(seconds_since(start), 3.9) << "the join timeout (4 s)";
  EXPECT_TRUE(contains(what, "1 node(s) joined elastic round 1")) << what;
  EXPECT_TRUE(contains(what, "fewer than the minimum of 2 (--nnodes 2:3)")) << what;
  EXPECT_TRUE(contains(what, fmt::format("(node {} of round 0)", first[1].node_rank))) << what;
}

}  // namespace
}  // namespace ddp::launcher
