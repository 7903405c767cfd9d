// Majorities of rounds (see Note [Never two groups] in quorum.h).
#include "quorum.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

namespace ddp::launcher {
namespace {

std::set<std::string> as_set(const std::vector<std::string>& ids) {
  return {ids.begin(), ids.end()};
}

}  // namespace

KnownRound newest_round(const KnownRound& store_last, const std::vector<RoundEntry>& arrivals,
                        std::string* conflict) {
  KnownRound newest = store_last;
  auto consider = [&](const KnownRound& k, const std::string& from) {
    if (k.round < 0) return;
    if (k.round > newest.round) {
      newest = k;
      return;
    }
    if (k.round == newest.round && as_set(k.members) != as_set(newest.members) &&
        conflict->empty()) {
      *conflict =
          fmt::format("round {} is reported with nodes {} and, by {}, with nodes {}", k.round,
                      fmt::join(newest.members, ","), from, fmt::join(k.members, ","));
    }
  };
  for (const RoundEntry& e : arrivals) {
    consider(KnownRound{.round = e.last_round, .members = e.last_members}, e.id);
  }
  if (newest.round >= 0 && newest.members.empty() && conflict->empty()) {
    *conflict = fmt::format("round {} is reported without its nodes (a ddprun of another version)",
                            newest.round);
  }
  return newest;
}

Quorum quorum_of(const KnownRound& last, const std::vector<RoundEntry>& arrivals,
                 const std::set<std::string>& left) {
  Quorum q{.last = last};
  int staying = 0;
  for (const std::string& id : last.members) {
    if (left.count(id)) continue;
    ++staying;
    const bool here =
        std::ranges::any_of(arrivals, [&](const RoundEntry& e) { return e.id == id; });
    (here ? q.present : q.missing).push_back(id);
  }
  q.needed = staying / 2 + 1;
  if (staying == 0) q.needed = 0;  // every node of it left: none of them forms anything again
  return q;
}

}  // namespace ddp::launcher
