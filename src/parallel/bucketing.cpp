// Bucket assignment (see Note [Bucket assignment]).
#include "parallel/bucketing.h"

#include <algorithm>
#include <map>

#include "base/check.h"

namespace ddp::detail {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<TensorSpec>& specs,
                                                const std::vector<size_t>& order,
                                                const std::vector<int64_t>& limits_bytes) {
  DDP_ASSERT(!limits_bytes.empty(), "no bucket size limits");
  DDP_ASSERT(order.size() == specs.size(), "order has {} entries for {} tensors", order.size(),
             specs.size());
  struct Open {
    std::vector<size_t> indices;
    int64_t bytes = 0;
    size_t limit_index = 0;  // which of limits_bytes applies to the key's next bucket
  };
  std::map<std::string, Open> open;  // by key
  std::vector<std::vector<size_t>> closed;
  std::vector<bool> seen(specs.size(), false);

  for (size_t idx : order) {
    DDP_ASSERT(idx < specs.size() && !seen[idx], "order is not a permutation (index {})", idx);
    seen[idx] = true;
    Open& b = open[specs[idx].key];
    b.indices.push_back(idx);
    b.bytes += specs[idx].bytes;
    const size_t li = std::min(b.limit_index, limits_bytes.size() - 1);
    if (b.bytes >= limits_bytes[li]) {
      closed.push_back(std::move(b.indices));
      b.indices.clear();
      b.bytes = 0;
      b.limit_index = li + 1;
    }
  }
  for (auto& [key, b] : open) {
    if (!b.indices.empty()) closed.push_back(std::move(b.indices));
  }

  // Launch order = order of each bucket's first tensor in `order`.
  std::vector<size_t> position(specs.size());
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
  std::sort(closed.begin(), closed.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return closed;
}

}  // namespace ddp::detail
