// ddprun's configuration (see launch_config.h).
#include "launch_config.h"

#include <algorithm>  // std::ranges::any_of

namespace ddp::launcher {

Std StdSpec::for_local_rank(int local_rank) const {
  if (by_local_rank.empty()) return all;
  auto it = by_local_rank.find(local_rank);
  return it == by_local_rank.end() ? Std::kNone : it->second;
}

bool StdSpec::any() const {
  if (all != Std::kNone) return true;
  return std::ranges::any_of(by_local_rank, [](const auto& kv) { return kv.second != Std::kNone; });
}

bool LaunchConfig::shows_on_console(int local_rank, Std stream) const {
  if (local_ranks_filter && local_ranks_filter->count(local_rank) == 0) return false;
  if (has(tee.for_local_rank(local_rank), stream)) return true;
  return !has(redirects.for_local_rank(local_rank), stream);
}

bool LaunchConfig::writes_to_file(int local_rank, Std stream) const {
  return has(tee.for_local_rank(local_rank), stream) ||
         has(redirects.for_local_rank(local_rank), stream);
}

}  // namespace ddp::launcher
