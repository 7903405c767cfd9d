// Internals of ProcessGroup and Work, shared by the files of src/process_group/ and by the
// library's other components (the comm hooks ask the transport's capabilities; the reducer
// annotates its buckets' flight records).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "base/completion.h"
#include "base/thread_annotations.h"
#include "ddp/process_group.h"
#include "process_group/collective.h"
#include "process_group/flight_recorder.h"
#include "process_group/hang_report.h"
#include "process_group/mailbox.h"
#include "process_group/shm_setup.h"
#include "process_group/transport/transport.h"
#include "process_group/work_state.h"

namespace ddp {

namespace detail {

// The one implementation of ProcessGroup (whose public header shows no state): made by
// make_process_group, every ProcessGroup is one, so the library reaches it with impl_of.
struct ProcessGroupImpl final : ProcessGroup {
  ProcessGroupImpl() = default;
  ~ProcessGroupImpl() override;

  // Constant after construction (make_process_group fills them before handing the group out).
  DistEnv env;  // rank, size, local placement as the group was formed
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<::c10d::Store> store;
  // What moves the data (Note [Transports]); its capabilities name the backend.
  std::unique_ptr<Transport> transport;
  std::optional<int> cuda_device;  // Note [Device binding]; nullopt: none bound
  // What subgroups inherit (Note [Subgroups] in make.cpp): `store`'s key prefix over the
  // rendezvous store, the backend asked for, detail::TestingOptions::host_id, the Gloo
  // interface and the group's name.
  std::string store_prefix;
  std::string requested_backend;
  std::optional<std::string> host_id;
  std::optional<std::string> gloo_interface;
  std::string group_name;

  // Diagnostics (Notes [Flight recorder], [Hang reports]): null when DDP_FLIGHT_RECORDER=0;
  // no reporter for a group of one.
  std::shared_ptr<flight::Ring> recorder;
  std::shared_ptr<HangReporter> reporter;
  // A handle on `store` of its own, every call bounded by kStoreCallLimit (the reporter's and
  // monitored_barrier's); `store` itself for a group of one, or when it cannot be cloned.
  c10::intrusive_ptr<::c10d::Store> diag_store;
  // DDP_DEBUG=detail: ranks compare each collective's CollectiveDesc before running it
  // (transports that do not compare calls themselves).
  bool check_calls = false;

  const Capabilities& caps() const { return transport->capabilities(); }
  // What the transport does with `t` (a backend pair's side for its device).
  const Capabilities& caps_for(const at::Tensor& t) const {
    return transport->capabilities_for(t.device().type());
  }

  // Held while a collective is numbered and handed to the transport, so that threads sharing
  // the group issue in sequence order. It guards an order, not a member: `seq` is atomic
  // (written under it, read without it by last_sequence_number() and errors).
  Mutex issue_mu;
  // Sequence number of the last collective issued (first is 1).
  std::atomic<uint64_t> seq{0};
  std::atomic<uint64_t> comm_buffers{0};        // comm_buffer() calls so far (shm buffer ids)
  std::atomic<uint64_t> subgroups{0};  // new_group() and split_group() calls so far (their keys)
  std::atomic<uint64_t> monitored_barriers{0};  // monitored_barrier() calls so far (store keys)
  // Collectives enqueued on a GPU stream whose CUDA event has not fired yet (Note [GPU
  // completion]); shared with their WorkStates, which add to it.
  std::shared_ptr<flight::InFlight> inflight = std::make_shared<flight::InFlight>();
  // send and recv (Note [Point to point] in mailbox.h): the messages of each channel so far, by
  // (peer, tag), and the mailbox of a transport without them (made at the first send or recv).
  Mutex p2p_mu;
  std::map<std::pair<int, int>, uint64_t> p2p_sent GUARDED_BY(p2p_mu);
  std::map<std::pair<int, int>, uint64_t> p2p_received GUARDED_BY(p2p_mu);
  std::unique_ptr<Mailbox> mailbox GUARDED_BY(p2p_mu);
  // Set when a collective ran past the timeout on the GPU and the transport was aborted: every
  // later collective fails at once with this text.
  std::string aborted GUARDED_BY(issue_mu);
};

inline ProcessGroupImpl& impl_of(ProcessGroup& pg) { return static_cast<ProcessGroupImpl&>(pg); }
inline const ProcessGroupImpl& impl_of(const ProcessGroup& pg) {
  return static_cast<const ProcessGroupImpl&>(pg);
}

}  // namespace detail

}  // namespace ddp
