// is_out_of_memory and out_of_memory_text (include/ddp/error.h): an allocation failure told
// apart from other errors, by type or by what LibTorch's allocators say (their exception types
// differ between LibTorch versions; their words do not).
#include <new>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/relayed_error.h"

namespace ddp {

bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return true;
  // Another rank's failure relayed here (its words may say "out of memory") is not this one's.
  if (relayed_from(e)) return false;
  const std::string_view what = e.what();
  return what.find("DefaultCPUAllocator") != std::string_view::npos ||
         what.find("out of memory") != std::string_view::npos;
}

std::string out_of_memory_text(const std::exception& e) {
  std::string_view first = e.what();
  first = first.substr(0, first.find('\n'));  // LibTorch appends a backtrace
  return fmt::format(
      "out of memory: {} (what this process may hold, its memory limit or the machine's, is "
      "less than it needs: a DistributedDataParallel replica holds the whole model, its "
      "gradients and the optimizer's state on every rank; FullyShardedDataParallel keeps "
      "1/world of each; or give each process more memory)",
      first);
}

}  // namespace ddp
