// retain_freed_memory: a block freed and allocated again, as a training step's activations
// are, comes back without page faults; a user's malloc settings win.
#include <sys/resource.h>  // getrusage

#include <cstdlib>
#include <cstring>

#include <gtest/gtest.h>

#include "ddp/allocator.h"

namespace ddp {
namespace {

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// One "step": allocate 8 MiB (above glibc's default mmap threshold), touch every page, free.
void step() {
  constexpr size_t kBytes = size_t{8} << 20;
  char* p = static_cast<char*>(std::malloc(kBytes));
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, kBytes);
  asm volatile("" : : "r"(p) : "memory");  // keep the writes
  std::free(p);
}

TEST(Allocator, UserSettingsWin) {
  setenv("MALLOC_TRIM_THRESHOLD_", "1000000", 1);
  EXPECT_FALSE(retain_freed_memory());
  unsetenv("MALLOC_TRIM_THRESHOLD_");
}

TEST(Allocator, StepsAfterTheFirstTakeNoPageFaults) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // scripts/sanitize.sh: ASan and TSan bring their own malloc, which mallopt does not tune.
  GTEST_SKIP() << "glibc malloc's settings: not under a sanitizer's allocator";
#endif
  ASSERT_TRUE(retain_freed_memory());
  step();  // the first step faults its pages in
  const long before = minor_faults();
  for (int i = 0; i < 5; ++i) step();
  // 5 steps x 2048 pages would fault ~10000 times if the memory went back to the kernel.
  EXPECT_LT(minor_faults() - before, 100);
}

}  // namespace
}  // namespace ddp
