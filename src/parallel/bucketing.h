// Bucket assignment: which gradients are all-reduced together. Pure: no tensors, no sockets.
//
// Note [Bucket assignment]
// Gradients are packed into flat buckets so that one all-reduce moves many small tensors, and
// a bucket's all-reduce starts as soon as its last gradient is ready. Walking the tensors in
// `order` (the expected ready order: reverse registration before the first iteration, the
// observed order after it), each tensor joins the open bucket of its (dtype, device) key:
// tensors of different dtypes or devices never share a bucket. A bucket closes once its size
// reaches its limit; a key's first bucket uses limits[0] (PyTorch: 1 MiB, so the first
// all-reduce starts early), later ones limits[1], limits[2], ... (the last limit repeats).
// Buckets come out ordered by the position of their first tensor in `order`, which is the
// order in which every rank launches them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ddp::detail {

struct TensorSpec {
  int64_t bytes = 0;
  std::string key;  // dtype and device, e.g. "Float/cpu"; only equal keys share a bucket
};

// Returns buckets as lists of indices into `specs`. `order` must be a permutation of
// [0, specs.size()); `limits_bytes` must be non-empty.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<TensorSpec>& specs,
                                                const std::vector<size_t>& order,
                                                const std::vector<int64_t>& limits_bytes);

}  // namespace ddp::detail
