// Internals of ProcessGroup and Work, shared by the files of src/process_group/ and by the
// library's other components (which need the c10d backend, e.g. for coalesced broadcasts).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>

#include "base/completion.h"
#include "c10d/compat.h"
#include "ddp/process_group.h"
#include "process_group/flight_recorder.h"
#include "process_group/hang_report.h"
#include "process_group/shm/group.h"
#include "process_group/shm_setup.h"

namespace ddp {

struct detail::ProcessGroupImpl {
  // Constant after construction.
  DistEnv env;               // rank, size, local placement as the group was formed
  std::string backend_name;  // "shm", "gloo" or "nccl"
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<::c10d::Store> store;
  // The transport, one of:
  //   "shm": `shm`, the shared-memory group of the whole group (every rank on this host);
  //   "gloo" / "nccl": `backend`, a c10d backend;
  //   "shm+gloo" (Note [Hierarchical collectives] in make.cpp): ranks on several hosts, the
  //     same number on each: `local_shm` (this host's ranks), `rail` (Gloo among the ranks of
  //     this local index, one per host) for all_reduce; `backend` (Gloo) for the others.
  std::shared_ptr<shm::Group> shm;
  c10::intrusive_ptr<c10d_compat::Backend> backend;
  std::shared_ptr<shm::Group> local_shm;
  c10::intrusive_ptr<c10d_compat::Backend> rail;
  ShmPeers shm_peers;           // the ranks sharing `shm` or `local_shm` (comm_buffer's exchange)
  int host_index = 0;           // "shm+gloo": this rank's host, its rank in the rail
  std::vector<int> rail_peers;  // "shm+gloo": the other ranks of the rail (one per other host)

  // Diagnostics (Notes [Flight recorder], [Hang reports]): null when DDP_FLIGHT_RECORDER=0;
  // no reporter for a group of one.
  std::shared_ptr<flight::Ring> recorder;
  std::shared_ptr<HangReporter> reporter;
  // A handle on `store` of its own, every call bounded by kStoreCallLimit (the reporter's and
  // monitored_barrier's); `store` itself for a group of one, or when it cannot be cloned.
  c10::intrusive_ptr<::c10d::Store> diag_store;
  // DDP_DEBUG=detail: ranks compare each collective's fingerprint before running it (Gloo-based
  // transports; shm compares fingerprints always).
  bool check_fingerprints = false;

  shm::Group* shared_memory() const { return shm ? shm.get() : local_shm.get(); }

  // Sequence number of the last collective issued (first is 1); written under issue_mu.
  std::mutex issue_mu;
  std::atomic<uint64_t> seq{0};
  std::atomic<uint64_t> comm_buffers{0};        // comm_buffer() calls so far (shm buffer ids)
  std::atomic<uint64_t> monitored_barriers{0};  // monitored_barrier() calls so far (store keys)
};

// Note [Work completion]
// A c10d work finishes its network part on a backend thread. Some of our operations need a
// local step afterwards (divide for kAvg on Gloo, sum the received chunks of a reduce_scatter).
// That step runs exactly once, in the first wait() (a Completion, src/base/completion.h); later
// waits return at once or rethrow the stored error. ddp::Future is built on the same primitive.
struct detail::WorkState {
  // Constant after construction.
  std::string op;      // "all_reduce"
  std::string detail;  // "sum, 1024 x Float"
  uint64_t seq = 0;
  int rank = 0;
  std::chrono::milliseconds timeout{0};
  std::chrono::steady_clock::time_point issued;
  c10::intrusive_ptr<::c10d::Work> work;  // a c10d backend's collective, or
  std::shared_ptr<shm::Group> shm_group;  // the shared-memory transport's
  std::shared_ptr<shm::Op> shm_op;
  std::function<void()> then;  // local completion step; may be empty; run by `done` only
  std::shared_ptr<flight::Ring> recorder;  // the group's (may be null)
  std::shared_ptr<HangReporter> reporter;  // the group's (may be null)

  Completion done;
};

// `error` (the failure of the collective of `s`), opened by the group's hang-report verdict
// when it has one (Note [Hang reports]); `error` itself otherwise.
std::exception_ptr explain_failure(const detail::WorkState& s, std::exception_ptr error);

}  // namespace ddp
