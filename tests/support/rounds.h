// Test support for ddprun's rounds with nodes as threads (tools/ddprun/rounds.h): every node
// joins a round at once, each on a thread of its own. Header-only; needs ddprun_lib.
#pragma once

#include <future>
#include <optional>
#include <vector>

#include <gtest/gtest.h>

#include "rounds.h"

namespace ddp::testing {

// Every node of `nodes` joins round `next` together; their memberships, in the same order (a
// node that could not join fails the test and reads as round -1).
inline std::vector<launcher::Membership> all_join(const std::vector<launcher::Rounds*>& nodes,
                                                  int next) {
  std::vector<std::future<std::optional<launcher::Membership>>> joined;
  for (launcher::Rounds* n : nodes) {
    joined.push_back(
        std::async(std::launch::async, [n, next] { return n->join(next, [] { return false; }); }));
  }
  std::vector<launcher::Membership> out;
  for (auto& j : joined) {
    std::optional<launcher::Membership> m = j.get();
    EXPECT_TRUE(m.has_value());
    out.push_back(m.value_or(launcher::Membership{.round = -1}));
  }
  return out;
}

}  // namespace ddp::testing
