// The process groups ddp-bench measures, and the one it keeps for its own bookkeeping.
//
// Note [Several groups, one store]
// make_process_group() has rank 0 host the rendezvous store on MASTER_PORT, so a second group
// formed the same way while the first is alive would try to host a second store on the same
// port. ddp-bench forms one control group first (Gloo: it hosts the store and carries the
// timings and verification counts), then forms every measured group as a client of that store:
// TORCHELASTIC_USE_AGENT_STORE=True, torchrun's word for "another process hosts the store",
// with DDP_AGENT_STORE=ddp (that store is rank 0's ddp-cpp store, not a TCPStore), set in this
// process around the call (ddp-bench is single-threaded there). Under torchrun's agent store
// the control group is already its client and the measured groups are too. Each group's keys
// live under its own group name. At world size 1 every group uses an in-process store.
#pragma once

#include <memory>
#include <string>

#include "ddp/process_group.h"

namespace ddp::bench {

// "shm-inplace" measures the shm transport on buffers from ProcessGroup::comm_buffer (where
// DDP keeps its buckets: reduced in place, no staging copies); "shm" on ordinary tensors.
inline bool uses_comm_buffers(const std::string& backend) { return backend == "shm-inplace"; }
inline std::string transport_of(const std::string& backend) {
  return uses_comm_buffers(backend) ? "shm" : backend;
}

class Groups {
 public:
  // Forms the control group from the launch environment (collective: every rank calls it).
  Groups();

  ProcessGroup& control() { return *control_; }
  int rank() const { return control_->rank(); }
  int size() const { return control_->size(); }

  // A group on `backend` named after it (see the Note). Collective. Returns null, with the
  // reason in `why`, when any rank could not form it (e.g. a backend this build lacks): every
  // rank then agrees it is unavailable.
  std::shared_ptr<ProcessGroup> form(const std::string& backend, std::string& why);

 private:
  std::shared_ptr<ProcessGroup> control_;  // constant after construction
};

}  // namespace ddp::bench
