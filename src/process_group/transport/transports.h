// The transports (Note [Transports] in transport.h), built by make_process_group.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "c10d/compat.h"
#include "process_group/shm_setup.h"  // ShmCommBuffers
#include "process_group/transport/transport.h"

namespace ddp {

// Every rank of the group on this host, sharing `group`; its comm buffers are made through
// `buffers` (over the same group).
std::unique_ptr<Transport> make_shm_transport(std::shared_ptr<shm::Group> group,
                                              ShmCommBuffers buffers);

// A LibTorch backend; `name` is "gloo" or "nccl". `timeout`: the group's, which also bounds how
// long destroying it waits for the data of sends not yet received (Note [Gloo point to point]).
std::unique_ptr<Transport> make_c10d_transport(std::string name,
                                               c10::intrusive_ptr<c10d_compat::Backend> backend,
                                               int size, std::chrono::milliseconds timeout);

// A c10d work as a transport's Pending: bounded by the collective's timeout, looking at this
// host's peers while it waits (Gloo); `on_stream`: NCCL's (Note [GPU completion]).
std::shared_ptr<Pending> c10d_pending(c10::intrusive_ptr<::c10d::Work> work, bool on_stream);

// Note [Backend pairs] (paired.cpp): `cpu` takes the CPU tensors' collectives, `cuda` the CUDA
// tensors'; what names no device goes to `cpu`.
std::unique_ptr<Transport> make_paired_transport(std::unique_ptr<Transport> cpu,
                                                 std::unique_ptr<Transport> cuda);

// Where the ranks of a hierarchical group run: rank_at[h][l] is the rank with local index l on
// host h (every host runs the same number, more than one).
struct HierarchyLayout {
  int rank = 0;
  int host = 0;   // this rank's host: its rank in its rail
  int local = 0;  // this rank's index on its host: its rail
  std::vector<std::vector<int>> rank_at;
  int hosts() const { return static_cast<int>(rank_at.size()); }
  int per_host() const { return static_cast<int>(rank_at.front().size()); }
  int size() const { return hosts() * per_host(); }
};

// Note [Hierarchical collectives]: `local` (this host's ranks, its comm buffers made through
// `buffers`), `rail` (Gloo among the ranks of this local index, one per host, in host order)
// and `flat` (Gloo over the whole group: DDP_DEBUG=detail's call comparison and dtypes the shm
// kernels do not know).
std::unique_ptr<Transport> make_hierarchy_transport(std::shared_ptr<shm::Group> local,
                                                    ShmCommBuffers buffers,
                                                    c10::intrusive_ptr<c10d_compat::Backend> rail,
                                                    c10::intrusive_ptr<c10d_compat::Backend> flat,
                                                    HierarchyLayout layout);

}  // namespace ddp
