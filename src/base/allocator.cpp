// retain_freed_memory (see include/ddp/allocator.h).
#include "ddp/allocator.h"

#include <malloc.h>  // mallopt

#include <climits>  // INT_MAX
#include <cstdlib>  // getenv
#include <initializer_list>

namespace ddp {

bool retain_freed_memory() {
  for (const char* user : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"}) {
    if (std::getenv(user) != nullptr) return false;  // the user's choice wins
  }
  constexpr int kLargestMmapThreshold = 32 << 20;  // glibc's cap on 64-bit (HEAP_MAX_SIZE / 2)
  const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, kLargestMmapThreshold) == 1;
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  return mmap_ok && trim_ok;
}

}  // namespace ddp
