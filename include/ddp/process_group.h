// A process group: the ranks of a job and the collectives they run together.
//
//   auto pg = ddp::make_process_group();           // env:// contract, backend "auto"
//   at::Tensor t = torch::ones({4}) * pg->rank();
//   pg->all_reduce(t, ddp::ReduceOp::kSum).wait(); // t = 0 + 1 + ... + (N-1) on every rank
//
// Forming a group (make_process_group): every rank connects to the rendezvous store that rank 0
// hosts on MASTER_ADDR:MASTER_PORT (or the launcher's agent hosts), registers, and waits until
// all WORLD_SIZE ranks have joined. A rank that never comes, a duplicate RANK, a WORLD_SIZE that
// differs between ranks, a port in use or an unreachable store is a ddp::RendezvousError or
// ddp::ConfigError on every rank, within the rendezvous timeout: never a hang, never a group
// with fewer ranks.
//
// Collectives are asynchronous: each returns a Work to wait() on. Every rank must issue the same
// collectives in the same order (as in PyTorch). Each carries a sequence number (per group,
// from 1) that errors quote, and is bounded by the group's timeout: wait() throws
// ddp::TimeoutError when peers do not arrive in time, ddp::CollectiveError when one failed.
//
// Thread-safety: a ProcessGroup may be shared between threads, but the issue order of its
// collectives must match across ranks. Works are independent values.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ddp/env.h"
#include "ddp/future.h"  // Future: Work::get_future
#include "ddp/reduce_op.h"

namespace ddp {

// kDefaultRendezvousTimeout and kDefaultCollectiveTimeout: ddp/env.h (ddprun shares them).

struct InitOptions {
  // "shm" (CPU tensors, every rank on this host), "gloo" (CPU tensors, any hosts), "shm+gloo"
  // (shared memory inside each host, Gloo between hosts: the same number > 1 of ranks on each),
  // "nccl" (CUDA builds) or "auto": for CPU tensors shm when every rank shares this host, else
  // shm+gloo where it can form, else gloo; in a CUDA build with a GPU visible, paired with nccl
  // for CUDA tensors ("cpu:shm,cuda:nccl", as PyTorch 2.x's default group; Note [auto on a GPU]
  // in src/process_group/make.cpp), one GPU per local rank. "tuned": auto, and
  // shm+gloo's large all_reduces over flat Gloo where that measured faster as the group formed
  // (not reproducible bit for bit: a timed choice may differ from run to run, and the two routes
  // sum in different orders). Or a backend per device type, as PyTorch 2.x takes it:
  // "cpu:gloo,cuda:nccl" ("cpu:shm", "cpu:auto", ... for the CPU side; "nccl" or "gloo" for the
  // CUDA side): each collective goes to the side of its tensors' device, whose tensors must all
  // be on one device type. backend() says which ("cpu:shm,cuda:nccl" for a pair).
  // Unset: DDP_BACKEND, else "auto".
  std::optional<std::string> backend;
  // Explicit placement (PyTorch's init_process_group(rank=, world_size=)); when both are set, the
  // launch environment is not consulted for them.
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<std::string> master_addr;  // default: MASTER_ADDR
  std::optional<int> master_port;          // default: MASTER_PORT
  // Unset: DDP_RDZV_TIMEOUT (seconds), else kDefaultRendezvousTimeout.
  std::optional<std::chrono::milliseconds> rendezvous_timeout;
  // Unset: DDP_COLLECTIVE_TIMEOUT (seconds), else kDefaultCollectiveTimeout.
  std::optional<std::chrono::milliseconds> timeout;
  // Network interface for Gloo (unset: GLOO_SOCKET_IFNAME, else the address that routes to
  // MASTER_ADDR, or 127.0.0.1 when every rank is on this node).
  std::optional<std::string> gloo_interface;
  // Store key namespace, so one store can host several groups.
  std::string group_name = "default";
  // The CUDA device this rank uses (an index into the visible devices), bound (cudaSetDevice)
  // before anything touches CUDA, so that NCCL and every CUDA allocation of this rank land on
  // it. Unset: LOCAL_RANK with the nccl backend; no device with the CPU backends.
  std::optional<int> device_id;
  // init_process_group() only (the default group): set this process's threads (LibTorch and the
  // BLAS), keep freed memory in malloc and record uncaught errors, each unless the user chose
  // otherwise (a count set before, a malloc tunable in the environment, a terminate handler of
  // its own). Unset: DDP_PROCESS_DEFAULTS (0 turns them off), else on.
  std::optional<bool> process_defaults;
  // Set: master_addr:master_port is a ddp-cpp store that outlives the ranks (a launcher's agent
  // store; ddp::ft::Manager's coordination store), joined under this run id's key (with
  // store_secret, else DDP_STORE_SECRET), instead of a store that rank 0 hosts. The group's keys
  // are under the run id and group_name. A stopped or dead rank then cannot freeze the store.
  std::optional<std::string> agent_store_run_id;
  std::optional<std::string> store_secret;
  // How long a rank whose collective failed waits for its peers' flight records, which its error
  // then describes (who is behind, stopped, gone). A peer on another host that died answers
  // nothing, so this is what the error costs then. Unset: 3 s. ddp::ft::Manager's groups wait
  // less by default: their failures are recovered from, and only noted.
  std::optional<std::chrono::milliseconds> hang_report_wait;
};

// A subgroup's own settings (ProcessGroup::new_group, split_group).
struct NewGroupOptions {
  // Unset: what the parent asked for, "shm+gloo" and "tuned" as "auto" (the subgroup's own
  // locality decides: members on one host get shm).
  std::optional<std::string> backend;
  // Unset: the parent's collective timeout.
  std::optional<std::chrono::milliseconds> timeout;
};

namespace detail {
struct WorkState;  // a Work's state, shared by its copies
}

// The outcome of one asynchronous collective. Copyable; copies share the same operation.
class Work {
 public:
  Work();
  ~Work();
  Work(const Work&);
  Work& operator=(const Work&);
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;

  // Blocks until the collective is done and its result is in the output tensors. Throws
  // ddp::TimeoutError / ddp::CollectiveError naming the rank, operation and sequence number.
  // Safe to call again (returns at once, or rethrows the same error).
  void wait();
  // True once wait() would return without blocking.
  bool is_completed() const;
  // e.g. "all_reduce #12 (sum, 1024 x Float)".
  std::string description() const;
  // The result as a Future (PyTorch's work.get_future(), for chaining with then()): its value
  // is the tensor the operation wrote (all_reduce, broadcast, reduce, recv, and the output of
  // scatter, reduce_scatter, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single)
  // or sent (send); undefined where the result is the list the caller passed (all_gather,
  // gather, all_to_all) or nothing (barrier). PyTorch's value is a list of those tensors.
  // Waiting for it waits for this Work and rethrows its error.
  Future get_future() const;

 private:
  friend class ProcessGroup;
  explicit Work(std::shared_ptr<detail::WorkState> state);
  Work(std::shared_ptr<detail::WorkState> state, at::Tensor result);
  std::shared_ptr<detail::WorkState> state_;
  at::Tensor result_;  // get_future()'s value
};

// Made by make_process_group() only; what it holds is the library's.
class ProcessGroup {
 public:
  virtual ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;
  int size() const;
  int local_rank() const;
  int local_size() const;
  const std::string& backend() const;         // "shm", "shm+gloo", "gloo", "nccl" or "cpu:X,cuda:Y"
  std::chrono::milliseconds timeout() const;  // collective timeout
  const DistEnv& env() const;                 // where this rank stands in the job
  uint64_t last_sequence_number() const;      // of the most recently issued collective
  // The CUDA device index this rank was bound to (InitOptions::device_id; with nccl, LOCAL_RANK
  // by default), or nullopt when the group bound none.
  std::optional<int> bound_device_id() const;

  // In-place reduction of `tensor` across ranks (kAvg divides by size()).
  [[nodiscard]] Work all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // Copies `tensor` of rank `root` into `tensor` on every rank.
  [[nodiscard]] Work broadcast(at::Tensor& tensor, int root = 0);
  // outputs[r] receives rank r's `input`; outputs must hold size() tensors shaped like input.
  [[nodiscard]] Work all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input);
  // output = reduction over ranks of inputs[rank()]; inputs holds size() tensors like output.
  [[nodiscard]] Work reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                    ReduceOp op = ReduceOp::kSum);
  // Completes once every rank has called barrier().
  [[nodiscard]] Work barrier();

  // The rest of torch.distributed's collectives, with PyTorch's semantics. Every rank calls
  // each one; every one is numbered, bounded by timeout() and named in errors like those above.
  // Over shm and shm+gloo, which have no native reduce, gather, scatter or all-to-all, they are
  // composed from the collectives above (Note [Composed collectives]).
  //
  // root's `tensor` receives the reduction over ranks (kAvg divides by size()); the others'
  // `tensor` is unspecified afterwards (it may hold a partial or the full result), as in PyTorch.
  [[nodiscard]] Work reduce(at::Tensor& tensor, int root = 0, ReduceOp op = ReduceOp::kSum);
  // root's outputs[r] receives rank r's `input`. On root `outputs` holds size() tensors shaped
  // like input; on every other rank it must be empty (PyTorch's gather_list).
  [[nodiscard]] Work gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                            int root = 0);
  // `output` receives root's inputs[rank()]. On root `inputs` holds size() tensors shaped like
  // output; on every other rank it must be empty (PyTorch's scatter_list).
  [[nodiscard]] Work scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                             int root = 0);
  // PyTorch's all_to_all_single: `input` is split along dim 0 into size() chunks, chunk j going
  // to rank j; `output`'s chunk i comes from rank i. Split sizes are rows along dim 0, one per
  // rank, and must agree across ranks (my input_split_sizes[j] == rank j's
  // output_split_sizes[me]); empty: size() equal chunks (dim 0 divisible by size()). Both
  // tensors have the same dtype and the same sizes past dim 0. Over shm and shm+gloo, uneven
  // splits take one extra all_reduce first (Note [Composed collectives]).
  [[nodiscard]] Work all_to_all_single(at::Tensor& output, const at::Tensor& input,
                                       const std::vector<int64_t>& output_split_sizes = {},
                                       const std::vector<int64_t>& input_split_sizes = {});
  // PyTorch's all_to_all: inputs[j] goes to rank j, outputs[i] comes from rank i (size() each;
  // any shapes, one dtype; outputs[i] has as many elements as rank i's inputs[me]).
  [[nodiscard]] Work all_to_all(std::vector<at::Tensor>& outputs,
                                const std::vector<at::Tensor>& inputs);
  // `output` (size() x input.numel() elements: [size() * d0, ...] or [size(), ...]) receives
  // every rank's `input`, in rank order.
  [[nodiscard]] Work all_gather_into_tensor(at::Tensor& output, const at::Tensor& input);
  // `input` (size() x output.numel() elements) is size() equal chunks; `output` receives the
  // reduction over ranks of their chunk rank().
  [[nodiscard]] Work reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input,
                                           ReduceOp op = ReduceOp::kSum);
  // Point to point, as torch.distributed's isend and irecv: `tensor` to rank `dst`, or from rank
  // `src`, matched by `tag` (0 to 16383) and by the order of the calls between the two ranks
  // with that tag. Only those two ranks take part, so the call takes no number in the group's
  // sequence; its description numbers it among the messages of its channel, the same on both
  // sides ("recv #3 (from rank 0, tag 7, 8 x Float)"). Bounded by timeout(). A send's and its
  // recv's tensors have the same dtype and number of elements (else the recv fails, naming both;
  // NCCL ignores tags and matches in call order, as in PyTorch). A send may complete before its
  // recv is posted (over shm always, over Gloo when small), or only once it is: two ranks that
  // exchange tensors use isend and irecv, then wait. Over shm they go through a shared-memory
  // mailbox (two copies; Note [Point to point]).
  [[nodiscard]] Work isend(const at::Tensor& tensor, int dst, int tag = 0);
  [[nodiscard]] Work irecv(at::Tensor& tensor, int src, int tag = 0);
  // Blocking: isend(...).wait(); recv returns `src`, as PyTorch's returns the sender's rank.
  void send(const at::Tensor& tensor, int dst, int tag = 0);
  int recv(at::Tensor& tensor, int src, int tag = 0);

  // A blocking barrier through the rendezvous store, like torch.distributed.monitored_barrier:
  // every rank reports its arrival; rank 0 waits up to `timeout` (unset: timeout()) for all
  // and throws ddp::TimeoutError naming every rank that did not arrive; the others wait as
  // long (plus 2 s for rank 0's answer) for rank 0's release and then fail with the same list. For debugging hangs: it costs
  // store round trips, not a collective, and does not take a sequence number.
  void monitored_barrier(std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  // Subgroups, as torch.distributed.new_group and split_group (Note [Subgroups]). Every rank of
  // this group calls them, in the same order; the members form a group among themselves, over
  // the transport their own locality allows, through this group's store, and get it; the other
  // ranks get nullptr. `ranks`: ranks of this group, no repeats, sorted as PyTorch sorts them
  // (a member's rank in the subgroup is its place among them); empty: every rank. Blocks until
  // every member has called, bounded by the rendezvous timeout.
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks = {},
                                          const NewGroupOptions& options = {});
  // Each list of `split_ranks` becomes a group (the lists must not overlap; a rank in none gets
  // nullptr). Each rank forms only its own group: cheaper than a new_group per list.
  std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& split_ranks,
                                            const NewGroupOptions& options = {});

  // A zeroed 1-D tensor of `numel` elements (CPU) that this group's collectives move without
  // copying: with the shm backend every rank of the host maps every rank's buffer, and an
  // all_reduce of a tensor inside it (the whole buffer or any contiguous part, at the same
  // offset on every rank) reduces the peers' data in place, with no copy in or out.
  // DistributedDataParallel keeps its gradient buckets in such buffers. Other backends return
  // ordinary memory. Collective: every rank calls it in the same order (relative to its other
  // comm_buffer calls) with the same numel and dtype; a rank whose memory limit refuses the
  // buffer makes every rank fall back to ordinary memory, with one line on stderr.
  at::Tensor comm_buffer(int64_t numel, const at::TensorOptions& options);
  // True when `t` lies in a comm buffer that this group's transport moves in place (shm); false
  // for ordinary memory, and on backends where comm buffers are ordinary memory.
  bool is_comm_buffer(const at::Tensor& t) const;

 protected:
  ProcessGroup() = default;
};

// Forms a new group (see the top of this file). Throws ddp::ConfigError for a malformed
// environment or options, ddp::RendezvousError when the ranks cannot form the group.
std::shared_ptr<ProcessGroup> make_process_group(const InitOptions& options = {});

}  // namespace ddp
