// The one wording of a desync: ranks that issued different collectives under one sequence
// number, whoever found it (the shm transport's fingerprints, DDP_DEBUG=detail's comparison
// before each collective, a hang report's verdict). Torch-free.
#pragma once

#include <string>
#include <string_view>

#include <fmt/format.h>

namespace ddp {

// "rank 0 issued all_reduce #5 (sum, 4 x Float), rank 1 issued broadcast #5 (root 0, ...)".
inline std::string desync_pair(int mine, std::string_view my_call, int other,
                               std::string_view their_call) {
  return fmt::format("rank {} issued {}, rank {} issued {}", mine, my_call, other, their_call);
}

// "[rank 0] collectives differ between ranks (<found_by>): rank 0 issued ..., rank 1 issued
// .... Every rank must issue ...".
inline std::string desync_error(int mine, std::string_view my_call, int other,
                                std::string_view their_call, std::string_view found_by) {
  return fmt::format(
      "[rank {}] collectives differ between ranks ({}): {}. Every rank must issue the same "
      "collectives in the same order, with the same dtypes, shapes and parameters.",
      mine, found_by, desync_pair(mine, my_call, other, their_call));
}

}  // namespace ddp
