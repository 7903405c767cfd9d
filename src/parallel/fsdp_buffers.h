// FullyShardedDataParallel's large CPU buffers (gathered flat parameters, flat gradients): mapped
// apart from the heap, and kept for reuse up to a bound (Note [FSDP buffers]).
#pragma once

#include <cstddef>
#include <map>
#include <memory>

#include <c10/core/Allocator.h>

#include "base/thread_annotations.h"

namespace ddp::detail {

// Note [FSDP buffers]
// FSDP frees and refills each unit's flat parameter every step (twice under ZeRO-3) and makes a
// flat gradient per unit per backward: the same few large sizes, over and over. From malloc
// (which, with retain_freed_memory, never gives memory back) they fragmented the heap: the
// first ZeRO-3 run under a memory limit (prlimit --data) had 206 MiB in use in a 499 MiB heap,
// more than DDP's whole heap, so the limit that stopped DDP stopped ZeRO-3 too. So on the CPU, buffers of at
// least kMinBytes are mappings of their own (mmap), which never fragment the heap: a freed one
// is kept for the next request of its exact size while the kept ones total at most `idle_limit`
// bytes (a step's working set: the units gathered for the whole step plus four of the largest,
// so a steady step maps nothing), and unmapped beyond. What is kept counts in memory_stats() as
// cached_bytes.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static constexpr size_t kMinBytes = size_t{1} << 20;

  explicit BufferPool(size_t idle_limit) : idle_limit_(idle_limit) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // `nbytes` of CPU memory, uninitialised; its deleter gives it back here (from any thread; the
  // pool lives while any of its buffers does). Throws ddp::Error saying "out of memory" when the
  // kernel refuses the mapping (a memory limit).
  c10::DataPtr take(size_t nbytes) EXCLUDES(mu_);
  size_t idle_bytes() const EXCLUDES(mu_);

 private:
  struct Block;
  static void give_back(void* block);

  mutable Mutex mu_;
  std::multimap<size_t, void*> idle_ GUARDED_BY(mu_);  // size -> mapping
  size_t idle_bytes_ GUARDED_BY(mu_) = 0;
  const size_t idle_limit_;
};

}  // namespace ddp::detail
