// BufferPool (Note [FSDP buffers] in fsdp_buffers.h).
#include "parallel/fsdp_buffers.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::detail {

struct BufferPool::Block {
  std::shared_ptr<BufferPool> pool;
  void* ptr;
  size_t nbytes;
};

BufferPool::~BufferPool() {
  MutexLock lock(&mu_);
  for (const auto& [nbytes, ptr] : idle_) ::munmap(ptr, nbytes);
}

c10::DataPtr BufferPool::take(size_t nbytes) {
  void* ptr = nullptr;
  {
    MutexLock lock(&mu_);
    if (auto it = idle_.find(nbytes); it != idle_.end()) {
      ptr = it->second;
      idle_.erase(it);
      idle_bytes_ -= nbytes;
    }
  }
  if (ptr == nullptr) {
    ptr = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      const int err = errno;
      throw Error(fmt::format(
          "FullyShardedDataParallel: out of memory: cannot map {} bytes for a unit's flat "
          "parameter or gradient ({})",
          nbytes, std::strerror(err)));
    }
  }
  auto* block = new Block{shared_from_this(), ptr, nbytes};
  return c10::DataPtr(ptr, block, &BufferPool::give_back, c10::Device(c10::kCPU));
}

void BufferPool::give_back(void* opaque) {
  std::unique_ptr<Block> block(static_cast<Block*>(opaque));
  BufferPool& pool = *block->pool;
  {
    MutexLock lock(&pool.mu_);
    if (pool.idle_bytes_ + block->nbytes <= pool.idle_limit_) {
      pool.idle_.emplace(block->nbytes, block->ptr);
      pool.idle_bytes_ += block->nbytes;
      return;
    }
  }
  ::munmap(block->ptr, block->nbytes);
}

size_t BufferPool::idle_bytes() const {
  MutexLock lock(&mu_);
  return idle_bytes_;
}

}  // namespace ddp::detail
