// Forming the shared-memory transport of a group whose ranks share one host.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ddp/env.h"
#include "process_group/shm/group.h"

namespace ddp {

struct ShmSetup {
  std::shared_ptr<shm::Group> group;  // null when the transport cannot be used...
  std::string why_not;                // ...and then why (the same text on every rank)
};

// A collective over `store` (keys under "shm/"): every rank of the group must call it. Locality
// is decided per group by comparing each rank's host identity (hostname, boot id, pid
// namespace) through the store, not from LOCAL_WORLD_SIZE (cpu-collectives.md §3.4); then rank 0
// creates the segment and every peer maps it (Note [Shared segments]). Every rank reads the
// same keys, so all agree on the outcome. Store reads are bounded by the store's timeout.
ShmSetup make_shm_group(::c10d::Store& store, const DistEnv& env,
                        std::chrono::milliseconds timeout);

// A collective over `store` (keys under "shm/buffer/"): every rank of `group` calls it with the
// same `id` (the group's allocation counter) and `bytes`. Each rank creates its part (a memfd of
// `bytes`, zeroed, pages reserved) and maps every peer's part through /proc/<pid>/fd, so the
// shared-buffer path of Note [Shared-memory collectives] can read and write them in place. The
// result is registered with `group`. Returns null on every rank when any rank could not create
// or map its part (memory limits): the caller then uses private memory, and the collectives
// stage it. Throws ddp::Error when ranks ask for different sizes (the calls are not collective).
std::shared_ptr<shm::SharedBuffer> make_shared_buffer(::c10d::Store& store, shm::Group& group,
                                                      const DistEnv& env, uint64_t id,
                                                      size_t bytes);

}  // namespace ddp
