// What one collective is, in the one form every part of the process group uses: the argument
// checks, the transports, the shared-memory fingerprint, the flight record, Work::description(),
// DDP_DEBUG=detail's desync check and the hang report's verdict. Torch-free (process_group.cpp
// maps at::ScalarType onto DType).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ddp/reduce_op.h"

namespace ddp {

enum class Collective : uint8_t {
  kAllReduce,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kBarrier,
  kReduce,
  kGather,
  kScatter,
  kAllToAll,
  // Point to point (two ranks, not numbered in the group's sequence: Note [Point to point]).
  kSend,
  kRecv,
};

// Element types the transports move. kOther: a type no kernel of ours reduces (complex, for
// instance); such data is described and moved as bytes.
enum class DType : uint8_t { kU8, kI8, kI16, kI32, kI64, kF16, kBF16, kF32, kF64, kBool, kOther };

size_t element_size(DType t);    // bytes; 1 for kOther (counted in bytes)
const char* name(DType t);       // LibTorch's names: "Float", "BFloat16", ...
const char* name(Collective c);  // "all_reduce"
std::optional<DType> dtype_named(std::string_view name);  // inverse of name(DType)
std::optional<Collective> collective_named(std::string_view name);
std::optional<ReduceOp> reduce_op_named(std::string_view name);

// One collective as every rank must issue it, plus its number in the group.
struct CollectiveDesc {
  Collective op = Collective::kBarrier;
  DType dtype = DType::kU8;
  ReduceOp reduce = ReduceOp::kSum;  // all_reduce, reduce_scatter, reduce
  int32_t root = 0;                  // broadcast, reduce, gather, scatter; send's and recv's peer
  uint64_t count = 0;  // elements per rank: all_reduce's, broadcast's and reduce's tensor,
                       // all_gather's and gather's input, reduce_scatter's and scatter's output,
                       // all_to_all's chunk for each peer (0: uneven splits)
  uint64_t seq = 0;    // the group's sequence number, from 1; 0: not numbered. send and recv:
                       // the message's number on its channel (sender, receiver, tag), from 1
  int32_t tag = 0;     // send, recv (last: the transports initialise the fields above in order)

  // The call without its number: two ranks whose collectives #seq differ here are out of step.
  bool same_call(const CollectiveDesc& other) const;
  bool operator==(const CollectiveDesc&) const = default;

  // "all_reduce #12 (sum, 1024 x Float)", "broadcast #3 (from rank 0, 1 x Long)",
  // "all_gather #4 (8 x Int)", "reduce #6 (sum to rank 1, 8 x Float)", "gather #7 (to rank 0,
  // 8 x Int)", "scatter #8 (from rank 2, 8 x Int)", "all_to_all #9 (4 x Float per peer)",
  // "all_to_all #10 (uneven splits, Float)", "barrier #5", "send #2 (to rank 1, tag 7, 8 x
  // Float)", "recv #2 (from rank 0, tag 7, 8 x Float)": the form every collective error uses.
  std::string describe() const;
  // The parenthesised part alone: "sum, 1024 x Float"; "" for a barrier.
  std::string detail() const;

  // A fixed-size encoding of the call (seq included) that ranks exchange to compare calls
  // (DDP_DEBUG=detail): 4 words. Collectives only (not the tag of send and recv).
  static constexpr size_t kWords = 4;
  std::array<int64_t, kWords> to_words() const;
  static CollectiveDesc from_words(const int64_t* words);
};

}  // namespace ddp
