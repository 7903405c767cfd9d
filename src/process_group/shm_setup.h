// Forming the shared-memory transport: where the ranks run, and the segments and buffers that
// the ranks of one host share.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ddp/env.h"
#include "process_group/shm/group.h"

namespace ddp {

// Where each rank of a group runs. Decided per group by comparing every rank's host identity
// (hostname, boot id, pid namespace, uid; or detail::TestingOptions::host_id) through the store, not from
// LOCAL_WORLD_SIZE (cpu-collectives.md §3.4): ranks may share memory when they run on the same
// kernel in the same pid namespace. Every rank reads every identity, so all agree.
struct Locality {
  std::vector<int> host;         // per rank: its host, numbered in order of their first rank
  std::vector<int> local_rank;   // per rank: its position among its host's ranks (rank order)
  std::vector<int> host_size;    // per host: how many ranks run there
  std::string first_difference;  // with several hosts: "ranks 0 and 2 are on different hosts..."

  int hosts() const { return static_cast<int>(host_size.size()); }
  bool uniform() const;                    // every host runs the same number of ranks
  std::vector<int> ranks_on(int h) const;  // in rank order
};

// This kernel's identity as ranks compare it: hostname, boot id, pid namespace, uid.
std::string host_identity();

// A collective over `store` (keys under "shm/host/"): every rank of the group calls it.
Locality exchange_locality(::c10d::Store& store, const DistEnv& env,
                           const std::optional<std::string>& host_id);

// The ranks that share one segment: `rank` of `size`, their keys under `prefix` in the store.
struct ShmPeers {
  std::string prefix;  // e.g. "shm/" (the whole group) or "shm/host1/"
  int rank = 0;        // within the peers
  int size = 1;
  std::vector<int> global;  // each peer's rank in the whole group, for messages
  std::string run_id;       // names the memfds (/proc/<pid>/maps), nothing else
};

struct ShmSetup {
  std::shared_ptr<shm::Group> group;  // null when the transport cannot be used...
  std::string why_not;                // ...and then why (the same outcome on every peer)
};

// A collective over the peers: local rank 0 creates the segment, every peer maps it (Note
// [Shared segments]); all learn whether every peer did. Store reads are bounded by the store's
// timeout.
ShmSetup make_shm_group(::c10d::Store& store, const ShmPeers& peers,
                        std::chrono::milliseconds timeout);

// A collective over the peers, with the same `id` (the group's allocation counter) and `bytes`
// on every peer. Each creates its part (a memfd of `bytes`, zeroed, pages reserved) and maps
// every other part through /proc/<pid>/fd, so the shared-buffer path of Note [Shared-memory
// collectives] reads and writes them in place. The result is registered with `group`. Returns
// null on every peer when any could not create or map a part (memory limits): the caller then
// uses private memory, and the collectives stage it. Throws ddp::Error when the peers ask for
// different sizes (the calls are not collective).
std::shared_ptr<shm::SharedBuffer> make_shared_buffer(::c10d::Store& store, shm::Group& group,
                                                      const ShmPeers& peers, uint64_t id,
                                                      size_t bytes);

// The comm buffers of the transports over shared memory (shm, and the hierarchy's host group):
// ProcessGroup::comm_buffer's memory, every peer's part mapped by every peer, reduced in place.
class ShmCommBuffers {
 public:
  ShmCommBuffers(c10::intrusive_ptr<::c10d::Store> store, std::shared_ptr<shm::Group> group,
                 ShmPeers peers);
  // A collective over the peers (make_shared_buffer): this peer's part, zeroed; undefined when
  // there is nothing to share (one peer, a CUDA or empty tensor) or the peers could not make it.
  at::Tensor make(uint64_t id, int64_t numel, const at::TensorOptions& options) const;
  // Whether `t` lies in one of this group's shared buffers.
  bool holds(const at::Tensor& t) const;

 private:
  c10::intrusive_ptr<::c10d::Store> store_;
  std::shared_ptr<shm::Group> group_;
  ShmPeers peers_;
};

}  // namespace ddp
