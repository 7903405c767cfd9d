// Element types, reductions and collective fingerprints of the shared-memory transport.
// Torch-free: src/process_group/process_group.cpp maps at::ScalarType and ddp::ReduceOp here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ddp::shm {

enum class DType : uint8_t { kU8, kI8, kI16, kI32, kI64, kF16, kBF16, kF32, kF64, kBool };
enum class Reduce : uint8_t { kSum, kAvg, kMax, kMin };
enum class OpKind : uint8_t { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier };

size_t element_size(DType t);
const char* name(DType t);   // LibTorch's names: "Float", "BFloat16", "Long"...
const char* name(Reduce r);  // "sum"
const char* name(OpKind k);  // "all_reduce"

// What every rank must agree on for one collective; compared at its first synchronisation.
struct Fingerprint {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::kU8;
  Reduce reduce = Reduce::kSum;
  int32_t root = 0;    // broadcast only
  uint64_t count = 0;  // elements per rank (all_reduce, broadcast, all_gather's input,
                       // reduce_scatter's output)

  bool operator==(const Fingerprint&) const = default;
  // "all_reduce #12 (sum, 1024 x Float)", the form every collective error uses.
  std::string describe(uint64_t seq) const;
};

}  // namespace ddp::shm
