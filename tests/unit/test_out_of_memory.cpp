// is_out_of_memory / out_of_memory_text (ddp/error.h): LibTorch's CPU allocator refusing a tensor
// (whatever its version calls the exception) and std::bad_alloc are allocation failures, worded
// on one line with what holds the memory and what to do; other errors are not.
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/relayed_error.h"

namespace ddp {
namespace {

TEST(OutOfMemory, LibTorchsAllocatorRefusingATensorIsOneWithItsRemedy) {
  try {
    at::Tensor t = at::empty({int64_t{1} << 50}, at::kFloat);  // 4 PiB: more than any address space
    FAIL() << "allocated " << t.nbytes() << " bytes";
  } catch (const std::exception& e) {
    ASSERT_TRUE(is_out_of_memory(e)) << e.what();
    const std::string text = out_of_memory_text(e);
    EXPECT_EQ(text.rfind("out of memory: ", 0), 0u) << text;
    EXPECT_NE(text.find("DefaultCPUAllocator"), std::string::npos) << text;  // LibTorch's words
    EXPECT_EQ(text.find('\n'), std::string::npos) << "the backtrace was kept: " << text;
    EXPECT_NE(text.find("a DistributedDataParallel replica holds the whole model, its gradients "
                        "and the optimizer's state on every rank; FullyShardedDataParallel "
                        "keeps 1/world of each"),
              std::string::npos)
        << text;
  }
}

TEST(OutOfMemory, BadAllocIsOneAndOtherErrorsAreNot) {
  EXPECT_TRUE(is_out_of_memory(std::bad_alloc()));
  EXPECT_EQ(out_of_memory_text(std::bad_alloc()).rfind("out of memory: std::bad_alloc (", 0), 0u);
  EXPECT_FALSE(is_out_of_memory(CollectiveError("[rank 1] all_reduce #3 timed out after 30 s")));
  EXPECT_FALSE(is_out_of_memory(std::runtime_error("cannot open data/train-images")));
  // Rank 1 ran out; the error that reaches this rank names it, and is not this rank's.
  EXPECT_FALSE(is_out_of_memory(Relayed<CollectiveError>(
      1, "[rank 1] out of memory: DefaultCPUAllocator: can't allocate memory")));
}

}  // namespace
}  // namespace ddp
