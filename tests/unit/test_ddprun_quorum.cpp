// The majority rule of elastic rounds (Note [Never two groups] in tools/ddprun/quorum.h), as
// pure functions: which round is the newest known, who counts, and the corner cases of joins and
// leaves between rounds.
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "quorum.h"

namespace ddp::launcher {
namespace {

// An arrival `id` that last ran round `last` with `members` (none: a new node).
RoundEntry arrival(const std::string& id, int last = -1, std::vector<std::string> members = {}) {
  return RoundEntry{.id = id,
                    .host = "h",
                    .addr = "-",
                    .last_round = last,
                    .last_members = std::move(members)};
}

Quorum verdict(const KnownRound& store_last, const std::vector<RoundEntry>& here,
               const std::set<std::string>& left = {}) {
  std::string conflict;
  Quorum q = quorum_of(newest_round(store_last, here, &conflict), here, left);
  q.conflict = conflict;
  return q;
}

TEST(Quorum, AMajorityOfTheLastRoundIsNeededAndEnough) {
  const KnownRound last{.round = 4, .members = {"a", "b", "c", "d"}};
  EXPECT_FALSE(verdict(last, {arrival("a", 4, last.members), arrival("b", 4, last.members)}).ok())
      << "2 of 4 is half, not a majority: the other half could do the same";
  const Quorum three = verdict(last, {arrival("a", 4, last.members), arrival("b", 4, last.members),
                                      arrival("c", 4, last.members)});
  EXPECT_TRUE(three.ok());
  EXPECT_EQ(three.needed, 3);
  EXPECT_EQ(three.missing, (std::vector<std::string>{"d"}));
  // Newcomers do not count towards it, but do not hurt either.
  EXPECT_FALSE(
      verdict(last, {arrival("a", 4, last.members), arrival("n1"), arrival("n2"), arrival("n3")})
          .ok());
}

TEST(Quorum, NodesThatLeftAreNotCounted) {
  const KnownRound last{.round = 2, .members = {"a", "b", "c", "d", "e"}};
  // d and e left with SIGTERM: a majority of a, b, c is 2.
  const Quorum q =
      verdict(last, {arrival("a", 2, last.members), arrival("b", 2, last.members)}, {"d", "e"});
  EXPECT_TRUE(q.ok());
  EXPECT_EQ(q.needed, 2);
  // Every node of it left: nothing of it can form a round again, so newcomers may.
  EXPECT_TRUE(verdict({.round = 1, .members = {"a"}}, {arrival("n")}, {"a"}).ok());
}

TEST(Quorum, AJobThatNeverRanNeedsNothing) {
  const Quorum q = verdict({}, {arrival("a"), arrival("b")});
  EXPECT_TRUE(q.ok());
  EXPECT_EQ(q.last.round, -1);
}

// Round 0 had a, b, c; round 1 (b, c, d, e) formed with 2 of them. Then the job is cut into
// {a, b} and {c, d, e}. a alone knows only round 0, where a and b are a majority; b knows
// round 1, so the {a, b} side is counted against it and loses; {c, d, e} wins.
TEST(Quorum, AMinorityOfTheNewRoundThatIsAMajorityOfTheOldOneLoses) {
  const std::vector<std::string> r0 = {"a", "b", "c"};
  const std::vector<std::string> r1 = {"b", "c", "d", "e"};
  const Quorum small = verdict({}, {arrival("a", 0, r0), arrival("b", 1, r1)});
  EXPECT_EQ(small.last.round, 1);
  EXPECT_FALSE(small.ok()) << "1 of round 1's 4";
  const Quorum large = verdict({}, {arrival("c", 1, r1), arrival("d", 1, r1), arrival("e", 1, r1)});
  EXPECT_TRUE(large.ok());
  // Even a store that still holds only round 0 (the side that kept the old store) counts a's
  // side against round 1 once b brings it.
  EXPECT_FALSE(
      verdict({.round = 0, .members = r0}, {arrival("a", 0, r0), arrival("b", 1, r1)}).ok());
}

// The store remembers the newest round even when none of its nodes comes back.
TEST(Quorum, TheStoresOwnRoundCountsWhenNoArrivalRanIt) {
  const KnownRound stored{.round = 7, .members = {"x", "y", "z"}};
  const Quorum q = verdict(stored, {arrival("a", 3, {"a", "x", "y"}), arrival("n")});
  EXPECT_EQ(q.last.round, 7);
  EXPECT_FALSE(q.ok());
  EXPECT_EQ(q.missing, (std::vector<std::string>{"x", "y", "z"}));
}

TEST(Quorum, TwoNodeSetsForOneRoundAreAConflict) {
  const Quorum q = verdict({.round = 3, .members = {"a", "b", "c"}},
                           {arrival("a", 3, {"a", "b", "c"}), arrival("d", 3, {"d", "e", "f"})});
  EXPECT_FALSE(q.ok());
  EXPECT_NE(q.conflict.find("round 3 is reported with nodes a,b,c and, by d, with nodes d,e,f"),
            std::string::npos)
      << q.conflict;
  // The same set in another order is the same round.
  EXPECT_TRUE(verdict({.round = 3, .members = {"a", "b", "c"}},
                      {arrival("c", 3, {"c", "a", "b"}), arrival("a", 3, {"a", "b", "c"})})
                  .ok());
  // A round without its nodes (a ddprun of another version) cannot be counted against.
  EXPECT_FALSE(verdict({}, {arrival("a", 5)}).ok());
}

TEST(Quorum, EntriesCarryTheirLastRoundsNodes) {
  RoundEntry e = arrival("h1:42:abc", 6, {"h1:42:abc", "h2:7:def"});
  e.last_rank = 1;
  const RoundEntry back = RoundEntry::parse(e.format(), 3);
  EXPECT_EQ(back.id, "h1:42:abc");
  EXPECT_EQ(back.last_round, 6);
  EXPECT_EQ(back.last_rank, 1);
  EXPECT_EQ(back.arrival, 3);
  EXPECT_EQ(back.last_members, e.last_members);
  // A new node's entry, and one written by a ddprun that did not carry members.
  EXPECT_TRUE(RoundEntry::parse(arrival("n").format(), 0).last_members.empty());
  const RoundEntry old = RoundEntry::parse("h3:1:aaa h3 10.0.0.3 2 0", 1);
  EXPECT_EQ(old.id, "h3:1:aaa");
  EXPECT_TRUE(old.last_members.empty());
}

}  // namespace
}  // namespace ddp::launcher
