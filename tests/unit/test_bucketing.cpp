// Bucket assignment (Note [Bucket assignment]) on its own: sizes, keys, limits, order.
#include <numeric>

#include <gtest/gtest.h>

#include "parallel/bucketing.h"

namespace ddp::detail {
namespace {

using Buckets = std::vector<std::vector<size_t>>;

std::vector<size_t> reversed(size_t n) {
  std::vector<size_t> o(n);
  std::iota(o.rbegin(), o.rend(), 0);
  return o;
}

TEST(Bucketing, SmallFirstBucketThenCapInReverseRegistrationOrder) {
  // Ten 400-byte tensors; first bucket 1000 bytes, then 2000.
  std::vector<TensorSpec> specs(10, TensorSpec{400, "Float/cpu"});
  Buckets b = assign_buckets(specs, reversed(10), {1000, 2000});
  // 9,8,7 reach 1200 >= 1000; then 5 tensors reach 2000; then the rest.
  EXPECT_EQ(b, (Buckets{{9, 8, 7}, {6, 5, 4, 3, 2}, {1, 0}}));
}

TEST(Bucketing, DtypesAndDevicesNeverShareABucket) {
  std::vector<TensorSpec> specs = {{100, "Float/cpu"},
                                   {100, "Double/cpu"},
                                   {100, "Float/cpu"},
                                   {100, "Float/cuda:0"},
                                   {100, "Double/cpu"}};
  Buckets b = assign_buckets(specs, reversed(5), {1 << 20});
  ASSERT_EQ(b.size(), 3u);
  for (const auto& bucket : b) {
    for (size_t i : bucket) EXPECT_EQ(specs[i].key, specs[bucket.front()].key);
  }
  // Ordered by their first tensor in `order` (4 is first: Double; then 3: cuda; then 2: Float).
  EXPECT_EQ(b, (Buckets{{4, 1}, {3}, {2, 0}}));
}

TEST(Bucketing, EachKeyHasItsOwnFirstLimit) {
  std::vector<TensorSpec> specs = {{600, "A"}, {600, "B"}, {600, "A"}, {600, "B"}, {600, "A"}};
  Buckets b = assign_buckets(specs, {0, 1, 2, 3, 4}, {1000, 5000});
  EXPECT_EQ(b, (Buckets{{0, 2}, {1, 3}, {4}}));
}

TEST(Bucketing, OversizedTensorGetsItsOwnBucketAndObservedOrderIsRespected) {
  std::vector<TensorSpec> specs = {{10, "F"}, {100000, "F"}, {10, "F"}};
  Buckets b = assign_buckets(specs, {2, 1, 0}, {50, 50});
  EXPECT_EQ(b, (Buckets{{2, 1}, {0}}));
  // Another order (e.g. observed after the first iteration) gives another layout.
  b = assign_buckets(specs, {0, 2, 1}, {50, 50});
  EXPECT_EQ(b, (Buckets{{0, 2, 1}}));
}

TEST(Bucketing, EveryTensorExactlyOnce) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 57; ++i) specs.push_back({(i * 37) % 500 + 1, i % 3 ? "F" : "D"});
  Buckets b = assign_buckets(specs, reversed(57), {300, 700});
  std::vector<int> count(57, 0);
  for (const auto& bucket : b) {
    EXPECT_FALSE(bucket.empty());
    for (size_t i : bucket) ++count[i];
  }
  for (int c : count) EXPECT_EQ(c, 1);
}

TEST(Bucketing, BadOrderIsOurBug) {
  std::vector<TensorSpec> specs(3, TensorSpec{1, "F"});
  EXPECT_ANY_THROW(assign_buckets(specs, {0, 0, 1}, {10}));
  EXPECT_ANY_THROW(assign_buckets(specs, {0, 1}, {10}));
}

}  // namespace
}  // namespace ddp::detail
