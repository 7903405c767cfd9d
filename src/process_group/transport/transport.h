// The transport interface: what moves a collective's data, under ProcessGroup.
//
// Note [Transports]
// ProcessGroup owns what every collective shares whatever carries it: the sequence number, the
// argument checks, the CollectiveDesc (collective.h), the flight record, the DDP_DEBUG=detail
// desync check, the timeout and the error that names rank, call and cause (work.cpp). A
// Transport only starts the data movement of one collective and says how to wait for it. The
// implementations (one file each in this folder):
//   shm        every rank on this host: one shared-memory group (shm/group.h);
//   c10d       a LibTorch backend: Gloo (CPU, any hosts) or NCCL (CUDA);
//   paired     a backend per device type ("cpu:gloo,cuda:nccl"): two of the others, each
//              collective routed by its tensors' device (Note [Backend pairs]);
//   hierarchy  ranks on several hosts, the same number L > 1 on each ("shm+gloo"): shared memory
//              inside each host, Gloo between hosts on rails (Note [Hierarchical collectives]);
//              with backend tuned its large all_reduces may go over flat Gloo instead (Note
//              [Choosing the all_reduce route] in process_group/route_choice.h).
// Each declares what it does natively (Capabilities), so that callers (the comm hooks,
// comm_buffer, the checks) ask "does it reduce bfloat16 / average in its reduction / move comm
// buffers in place" instead of comparing backend names.
// Calls into a transport are serialised by ProcessGroup (issue order = sequence order).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "process_group/collective.h"

namespace ddp {
class ProcessGroup;
namespace detail {
struct WorkState;
}

// send's and recv's tags are below this (Note [Gloo point to point] in transport/c10d.cpp).
inline constexpr int kTagLimit = 1 << 14;

// What a transport does itself, typed.
struct Capabilities {
  std::string name;               // "shm", "gloo", "nccl", "shm+gloo": ProcessGroup::backend()
  uint32_t reduced_dtypes = 0;    // bit (1 << DType): reduced natively, in that dtype's values
  uint32_t reducible_dtypes = 0;  // reduced at all (natively, or by a fallback inside)
  bool native_avg = false;        // ReduceOp::kAvg inside the reduction (no pass by the caller)
  bool in_place_comm_buffers = false;  // comm_buffer() memory is reduced in place, zero copy
  bool can_abort = false;              // a failure ends every later collective of the group at once
  bool checks_calls = false;  // compares every collective's CollectiveDesc across ranks itself
  bool announces_departure = false;  // peers learn of a destroyed group without the store
  // reduce, gather, scatter and all_to_all (uneven splits too) natively; else ProcessGroup
  // composes them from the transport's all_reduce, all_gather and broadcast (Note [Composed
  // collectives] in process_group/composed.h).
  bool rooted_collectives = false;
  // send and recv natively; else ProcessGroup moves them through its mailbox (shared memory and
  // the store: Note [Point to point] in process_group/mailbox.h), which needs every rank on
  // this host.
  bool point_to_point = false;
  bool cpu_tensors = true;
  bool cuda_tensors = false;
  // A backend per device type (Note [Backend pairs] in paired.cpp): a collective's tensors must
  // all be on one device type, whose side carries it.
  bool routed_by_device = false;

  bool reduces(DType t) const { return (reduced_dtypes >> static_cast<unsigned>(t)) & 1u; }
  bool can_reduce(DType t) const { return (reducible_dtypes >> static_cast<unsigned>(t)) & 1u; }
  // Every reducing op on `t` (kAvg on floating types); the transport's own dtype, no widening.
  static uint32_t all_dtypes_but(std::initializer_list<DType> excluded);
};

// A transport with a second way to all-reduce (the hierarchy: flat Gloo over the whole group,
// Note [Choosing the all_reduce route] in route_choice.h) takes it for all_reduces of at least
// flat_route_from() bytes (kNever: never), or for every all_reduce while a route is forced (the
// measurement's). Called between collectives, in issue order.
class RouteTuning {
 public:
  static constexpr uint64_t kNever = UINT64_MAX;
  virtual ~RouteTuning() = default;
  virtual void set_flat_route_from(uint64_t bytes) = 0;
  virtual uint64_t flat_route_from() const = 0;
  // true: every all_reduce flat, false: none, nullopt: by size again.
  virtual void force_route(std::optional<bool> flat) = 0;
};

// A started collective.
class Pending {
 public:
  virtual ~Pending() = default;
  // Blocks until the transfer is done, bounded by `s.timeout`; throws its failure (ddp::Error,
  // or the library's exception for work.cpp to classify).
  virtual void wait(const detail::WorkState& s) = 0;
  virtual bool is_completed() const = 0;
  // True when wait() returns once the work is enqueued on the caller's GPU stream (NCCL, as in
  // c10d: the stream, not the CPU, waits for the result); is_completed() then says whether its
  // CUDA event has fired (Note [GPU completion]).
  virtual bool on_stream() const { return false; }
};

struct Started {
  std::shared_ptr<Pending> pending;  // null: done already (nothing was sent)
  // A local step after the transfer (copy a staged result back, divide, reduce received
  // chunks); runs once, in the first wait(). May be empty.
  std::function<void()> then;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const Capabilities& capabilities() const = 0;
  // What it does with tensors on `device`: capabilities(), but for a backend pair (Note [Backend
  // pairs] in paired.cpp), whose sides differ.
  virtual const Capabilities& capabilities_for(c10::DeviceType /*device*/) const {
    return capabilities();
  }

  // The collectives, arguments checked by ProcessGroup; `call` says what they are (the tensors'
  // dtype, count, the reduce op, the root) and carries the sequence number.
  virtual Started all_reduce(const CollectiveDesc& call, at::Tensor& tensor) = 0;
  virtual Started broadcast(const CollectiveDesc& call, at::Tensor& tensor) = 0;
  virtual Started all_gather(const CollectiveDesc& call, std::vector<at::Tensor>& outputs,
                             const at::Tensor& input) = 0;
  virtual Started reduce_scatter(const CollectiveDesc& call, at::Tensor& output,
                                 const std::vector<at::Tensor>& inputs) = 0;
  virtual Started barrier(const CollectiveDesc& call) = 0;

  // Only where capabilities().rooted_collectives (ProcessGroup composes them elsewhere):
  //   reduce: the reduction lands in root's `tensor`; the others' `tensor` is left unspecified.
  //   gather: root's outputs[r] receives rank r's input; `outputs` is empty on the other ranks.
  //   scatter: `output` receives root's inputs[rank]; `inputs` is empty on the other ranks.
  //   all_to_all: flat tensors; input's chunk j goes to rank j, output's chunk j comes from rank
  //     j, chunks split by the sizes in elements (both empty: size() equal chunks).
  virtual Started reduce(const CollectiveDesc& call, at::Tensor& tensor);
  virtual Started gather(const CollectiveDesc& call, std::vector<at::Tensor>& outputs,
                         const at::Tensor& input);
  virtual Started scatter(const CollectiveDesc& call, at::Tensor& output,
                          const std::vector<at::Tensor>& inputs);
  virtual Started all_to_all(const CollectiveDesc& call, at::Tensor& output,
                             const at::Tensor& input, const std::vector<int64_t>& output_splits,
                             const std::vector<int64_t>& input_splits);

  // Only where capabilities().point_to_point: `tensor` (contiguous) to or from rank call.root,
  // matched by call.tag (below kTagLimit) and call.seq, its number on that channel. A send may complete
  // before the peer received it (its data is then copied).
  virtual Started send(const CollectiveDesc& call, const at::Tensor& tensor);
  virtual Started recv(const CollectiveDesc& call, at::Tensor& tensor);

  // Why rank `peer` can take part in nothing more (it left the group, its process is gone), or
  // "" while it may, or where the transport cannot tell. From any thread; cheap (the mailbox's
  // recv asks it every few tens of milliseconds while it waits).
  virtual std::string peer_gone(int /*peer*/) const { return ""; }

  // Every rank's `mine`, outside the numbering, within `timeout` (DDP_DEBUG=detail compares
  // them before each collective). nullopt where the transport cannot (or checks_calls: need not).
  virtual std::optional<std::vector<CollectiveDesc>> gather_calls(
      const CollectiveDesc& mine, std::chrono::milliseconds timeout);

  // Ends every collective in flight and every later one at once (capabilities().can_abort):
  // NCCL's communicator abort, after a collective ran past the timeout on the GPU.
  virtual void abort() {}

  // ProcessGroup::comm_buffer's memory: `numel` zeroed CPU elements that this transport moves in
  // place (capabilities().in_place_comm_buffers: shared memory every rank of the host maps),
  // made collectively (`id`: the group's count of comm buffers, the same on every rank).
  // Undefined where the transport has none, or could not make one: the group then hands out
  // ordinary memory.
  virtual at::Tensor comm_buffer(uint64_t /*id*/, int64_t /*numel*/,
                                 const at::TensorOptions& /*options*/) {
    return {};
  }
  // Whether `t` lies in a comm buffer of this transport.
  virtual bool is_comm_buffer(const at::Tensor& /*t*/) const { return false; }

  // The one tuning hook: a second way to all-reduce, where the transport has one (the hierarchy:
  // flat Gloo), else null.
  virtual RouteTuning* route_tuning() { return nullptr; }
};

// What `pg`'s transport does (for the library's other components: checkpoints, hooks), without
// the group's internals (process_group/internal.h).
const Capabilities& capabilities_of(ProcessGroup& pg);
// What it does with tensors on `device` (a backend pair's side: Note [Backend pairs]).
const Capabilities& capabilities_of(ProcessGroup& pg, c10::DeviceType device);

}  // namespace ddp
