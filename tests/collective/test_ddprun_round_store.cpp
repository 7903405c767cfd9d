// ddprun's round store (Note [Round store keys] in tools/ddprun/round_store.h) over a real agent
// store on 127.0.0.1: each accessor writes the key and the value the Note lists (read back raw,
// so that the wire format cannot drift from the Note), the round only grows, first writers win,
// a final failure is marked before the failure, and numbers that are not numbers are refused
// with one text.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "agent_store.h"  // host_agent_store
#include "base/net.h"     // pick_free_port
#include "ddp/error.h"
#include "round_store.h"
#include "store/client.h"
#include "store/protocol.h"  // job_key

namespace ddp::launcher {
namespace {

using Clock = store::Clock;
using namespace std::chrono_literals;

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

class RoundStoreTest : public ::testing::Test {
 protected:
  static std::unique_ptr<store::Server> host(int port) {
    LaunchConfig c;
    c.master_addr = "127.0.0.1";
    c.master_port = port;
    return host_agent_store(c, EnvMap{}, store::job_key("secret", "run"), "secret", "[test]");
  }
  static store::ClientOptions options(int port) {
    return {.host = "127.0.0.1",
            .port = port,
            .key = store::job_key("secret", "run"),
            .who = "[test]",
            .owner = "the test"};
  }
  static Clock::time_point soon() { return Clock::now() + 5s; }
  // A key as it is on the wire, "" when unset.
  std::string raw(const std::string& key) {
    if (!raw_.check({key}, soon())) return "";
    return raw_.get(key, 0ms, soon());
  }

  // In this order: the store, then its clients.
  const int port_ = net::pick_free_port();
  const std::unique_ptr<store::Server> server_ = host(port_);
  const store::ClientOptions options_ = options(port_);
  store::Client raw_{options_};
};

TEST_F(RoundStoreTest, TheRoundOnlyGrows) {
  RoundStore keys("run", options_);
  EXPECT_EQ(keys.round(soon()), std::nullopt);
  EXPECT_EQ(keys.raise_round(0, soon()), 0);
  EXPECT_EQ(keys.raise_round(3, soon()), 3);
  EXPECT_EQ(keys.raise_round(1, soon()), 3) << "a lower round is no round";
  EXPECT_EQ(keys.round(soon()), 3);
  EXPECT_EQ(raw("ddprun/run/round"), "3");
}

TEST_F(RoundStoreTest, TheKeysAreTheNotes) {
  RoundStore keys("run", options_);
  EXPECT_EQ(keys.claim_shape("--nnodes 2, --nproc-per-node 1", soon()),
            "--nnodes 2, --nproc-per-node 1");
  EXPECT_EQ(keys.claim_shape("--nnodes 3, --nproc-per-node 1", soon()),
            "--nnodes 2, --nproc-per-node 1")
      << "the first node's shape stands";
  EXPECT_EQ(raw("ddprun/run/shape"), "--nnodes 2, --nproc-per-node 1");
  EXPECT_EQ(keys.claim_lineage("3fa2", soon()), "3fa2");
  EXPECT_EQ(keys.claim_lineage("9c01", soon()), "3fa2") << "the store's lineage stands";
  EXPECT_EQ(raw("ddprun/run/lineage"), "3fa2");

  keys.beat("1", soon());
  keys.beat("1", soon());
  EXPECT_EQ(keys.beats("1", soon()), 2);
  EXPECT_EQ(raw("ddprun/run/alive/1"), "2");

  EXPECT_EQ(keys.claim_rank(4, 1, soon()), 1);
  EXPECT_EQ(keys.claim_rank(4, 1, soon()), 2) << "a rank claimed twice";
  EXPECT_TRUE(keys.rank_claimed(4, 1, soon()));
  EXPECT_FALSE(keys.rank_claimed(4, 0, soon()));
  EXPECT_EQ(raw("ddprun/run/4/node/1"), "2");

  EXPECT_EQ(keys.count_in(4, soon()), 0);
  EXPECT_EQ(keys.count_in(4, soon()), 1);
  EXPECT_EQ(keys.arrivals(4, soon()), 2);
  EXPECT_EQ(raw("ddprun/run/4/count"), "2");
  keys.write_entry(
      4, 0, {.id = "h1:17:ab", .host = "h1", .addr = "10.0.0.1", .last_round = 3, .last_rank = 0},
      soon());
  EXPECT_EQ(raw("ddprun/run/4/member/0"), "h1:17:ab h1 10.0.0.1 3 0 -");
  keys.write_entry(4, 1,
                   {.id = "h2:18:cd",
                    .host = "h2",
                    .addr = "-",
                    .last_round = 3,
                    .last_rank = 1,
                    .last_members = {"h1:17:ab", "h2:18:cd"}},
                   soon());
  EXPECT_EQ(raw("ddprun/run/4/member/1"), "h2:18:cd h2 - 3 1 h1:17:ab,h2:18:cd");

  // The newest round that began here: only raised.
  EXPECT_EQ(keys.last_round(soon()).round, -1);
  keys.record_round({.round = 4, .members = {"h1:17:ab", "h2:18:cd"}}, soon());
  keys.record_round({.round = 3, .members = {"h1:17:ab"}}, soon());
  EXPECT_EQ(raw("ddprun/run/last_round"), "4 h1:17:ab,h2:18:cd");
  EXPECT_EQ(keys.last_round(soon()).members, (std::vector<std::string>{"h1:17:ab", "h2:18:cd"}));

  EXPECT_EQ(keys.closed(4, soon()), std::nullopt);
  EXPECT_EQ(keys.close(4, 2, soon()), 2);
  EXPECT_EQ(keys.close(4, 1, soon()), 2) << "closed once";
  EXPECT_EQ(raw("ddprun/run/4/closed"), "2");

  keys.finish(4, "node 1 (h1)", soon());
  keys.end(4, soon());
  EXPECT_EQ(keys.ended(4, soon()), 1);
  EXPECT_EQ(raw("ddprun/run/4/finished"), "node 1 (h1)");
  EXPECT_EQ(raw("ddprun/run/4/ended"), "1");

  EXPECT_EQ(keys.write_regroup(4, "node h2 leaves", soon()), "node h2 leaves");
  EXPECT_EQ(keys.write_regroup(4, "another reason", soon()), "node h2 leaves");
  keys.saw_regroup(4, soon());
  keys.leave(4, "h2:18:cd", soon());
  keys.send_store_home(4, soon());
  EXPECT_FALSE(keys.store_goes_away(4, soon()));
  keys.send_store_away(4, soon());
  EXPECT_TRUE(keys.store_goes_away(4, soon()));
  EXPECT_EQ(raw("ddprun/run/4/store_away"), "1");
  EXPECT_EQ(raw("ddprun/run/4/regroup"), "node h2 leaves");
  EXPECT_EQ(raw("ddprun/run/4/regroup_seen"), "1");
  EXPECT_EQ(raw("ddprun/run/4/left/h2:18:cd"), "1");
  EXPECT_EQ(raw("ddprun/run/4/store_home"), "1");
  EXPECT_TRUE(keys.said_over(4, soon()));
  EXPECT_FALSE(keys.said_over(5, soon()));

  EXPECT_EQ(keys.failures(soon()), 0);
  EXPECT_EQ(keys.count_failure(soon()), 1);
  keys.carry_failures(3, soon());
  keys.carry_failures(2, soon());
  EXPECT_EQ(keys.failures(soon()), 3) << "carried up, never down";
  EXPECT_EQ(raw("ddprun/run/failures"), "3");
}

// Note [Final failures]: "final" is written before "failed", so that whoever sees the failure
// sees whether it is final; the first failure wins.
TEST_F(RoundStoreTest, TheFirstFailureWinsAndAFinalOneIsMarkedFirst) {
  RoundStore keys("run", options_);
  EXPECT_FALSE(keys.failed(0, soon()));
  EXPECT_EQ(keys.write_first_failure(0, "node 1 (h1): rank 2 failed (exit code 2)", true, soon()),
            std::nullopt);
  EXPECT_EQ(raw("ddprun/run/0/final"), "node 1 (h1): rank 2 failed (exit code 2)");
  EXPECT_EQ(raw("ddprun/run/0/failed"), "node 1 (h1): rank 2 failed (exit code 2)");
  EXPECT_TRUE(keys.failure_is_final(0, soon()));
  EXPECT_EQ(keys.write_first_failure(0, "node 0 (h0): rank 0 failed", false, soon()),
            "node 1 (h1): rank 2 failed (exit code 2)");
  EXPECT_EQ(keys.failure(0, soon()), "node 1 (h1): rank 2 failed (exit code 2)");

  // A final failure that comes second is not final: the first one decides.
  EXPECT_EQ(keys.write_first_failure(1, "node 0 (h0): rank 0 failed", false, soon()), std::nullopt);
  keys.write_first_failure(1, "node 1 (h1): rank 3 failed (exit code 2)", true, soon());
  EXPECT_FALSE(keys.failure_is_final(1, soon()));
  EXPECT_EQ(keys.final_failure(1, soon()), std::nullopt);
}

TEST_F(RoundStoreTest, EntriesAreReadOnceAndAMissingOneIsUnknown) {
  RoundStore keys("run", options_);
  keys.write_entry(0, 0, {.id = "0", .host = "h0", .addr = "-"}, soon());
  const auto start = Clock::now();
  std::vector<RoundEntry> two = keys.entries(0, 2, 200ms);
  EXPECT_LT(Clock::now() - start, 2s);
  ASSERT_EQ(two.size(), 2U);
  EXPECT_EQ(two[0].id, "0");
  EXPECT_EQ(two[0].last_round, -1);
  EXPECT_EQ(two[1].id, "?") << "never written within the wait: an unknown node";
  EXPECT_EQ(two[1].arrival, 1);
  EXPECT_EQ(RoundEntry::parse("garbled", 3).id, "?");
  EXPECT_EQ(RoundEntry::parse("a h 1.2.3.4 7 2", 0).format(), "a h 1.2.3.4 7 2 -");
}

// A store moved (back home): round R's entries there are another store's, read anew.
TEST_F(RoundStoreTest, EntriesAreReadAgainInAnotherStore) {
  const int other_port = net::pick_free_port();
  const std::unique_ptr<store::Server> other = host(other_port);
  RoundStore here("run", options(other_port));
  here.write_entry(1, 0, {.id = "h2", .host = "h2", .addr = "-"}, soon());
  EXPECT_EQ(here.entries(1, 1, 200ms).front().id, "h2");
  RoundStore home("run", options_);
  home.write_entry(1, 0, {.id = "h0", .host = "h0", .addr = "-"}, soon());
  here.connect(options_);
  EXPECT_EQ(here.entries(1, 1, 200ms).front().id, "h0");
}

TEST_F(RoundStoreTest, ANumberThatIsNotOneIsRefusedNamingTheKey) {
  RoundStore keys("run", options_);
  raw_.set("ddprun/run/round", "seven", soon());
  std::string error = "(no error)";
  try {
    keys.raise_round(0, soon());
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_TRUE(contains(error,
                       "the agent store's round is 'seven', not a number: another program "
                       "wrote to this job's keys"))
      << error;
  raw_.set("ddprun/run/failures", "-1", soon());
  EXPECT_THROW(keys.failures(soon()), Error);
}

}  // namespace
}  // namespace ddp::launcher
