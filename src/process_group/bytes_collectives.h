// Small collectives of integers and byte strings, for the library's own bookkeeping (checkpoint
// outcomes, gathered per-rank states): the tensors go where the group's transport takes them
// (the CPU, or the rank's bound device for a transport of CUDA tensors only: NCCL).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp {

class ProcessGroup;

// `root`'s value on every rank.
int64_t broadcast_i64(ProcessGroup& group, int64_t value, int root = 0);
// `root`'s bytes on every rank; `size` is their length, already known everywhere.
std::string broadcast_bytes(ProcessGroup& group, const std::string& bytes, int64_t size,
                            int root = 0);
// Every rank's value, on every rank.
std::vector<int64_t> all_gather_i64(ProcessGroup& group, int64_t value);
// Every rank's `mine` (byte strings of any length), on every rank.
std::vector<std::string> all_gather_bytes(ProcessGroup& group, const std::string& mine);

}  // namespace ddp
