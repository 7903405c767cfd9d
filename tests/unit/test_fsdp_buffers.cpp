// BufferPool (Note [FSDP buffers] in src/parallel/fsdp_buffers.h): a freed buffer is taken again
// by the next request of its size, the kept ones stay within the bound, a buffer outlives the
// pool's other owners, and a mapping the kernel refuses is an out-of-memory error.
#include <cstring>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "ddp/error.h"
#include "parallel/fsdp_buffers.h"

namespace ddp::detail {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(FsdpBuffers, AFreedBufferIsTakenAgainAndWhatIsKeptStaysWithinTheBound) {
  auto pool = std::make_shared<BufferPool>(/*idle_limit=*/3 * kMiB);
  void* first = nullptr;
  {
    c10::DataPtr a = pool->take(2 * kMiB);
    first = a.get();
    std::memset(first, 1, 2 * kMiB);
  }
  EXPECT_EQ(pool->idle_bytes(), 2 * kMiB);
  {
    c10::DataPtr again = pool->take(2 * kMiB);
    EXPECT_EQ(again.get(), first);
    EXPECT_EQ(pool->idle_bytes(), 0u);
    c10::DataPtr other_size = pool->take(kMiB);  // never a kept buffer of another size
    EXPECT_NE(other_size.get(), first);
  }
  EXPECT_EQ(pool->idle_bytes(), 3 * kMiB);  // 2 + 1 MiB: at the bound
  {
    c10::DataPtr a = pool->take(2 * kMiB), b = pool->take(2 * kMiB);
    EXPECT_EQ(pool->idle_bytes(), kMiB);
  }  // one 2 MiB buffer is kept again, the other unmapped: 1 + 2 MiB
  EXPECT_EQ(pool->idle_bytes(), 3 * kMiB);
}

TEST(FsdpBuffers, ABufferOutlivesThePool) {
  auto pool = std::make_shared<BufferPool>(4 * kMiB);
  c10::DataPtr kept = pool->take(kMiB);
  pool.reset();
  std::memset(kept.get(), 7, kMiB);  // still mapped; freeing it afterwards unmaps it
  EXPECT_EQ(static_cast<unsigned char*>(kept.get())[kMiB - 1], 7);
}

TEST(FsdpBuffers, AMappingTheKernelRefusesIsAnOutOfMemoryError) {
  auto pool = std::make_shared<BufferPool>(0);
  try {
    c10::DataPtr huge = pool->take(size_t{1} << 60);
    FAIL() << "mapped 2^60 bytes";
  } catch (const Error& e) {
    EXPECT_TRUE(is_out_of_memory(e)) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot map 1152921504606846976 bytes"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace ddp::detail
