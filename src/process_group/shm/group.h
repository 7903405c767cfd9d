// The shared-memory transport: the collectives of ranks that share one host, through one
// segment that every rank maps.
//
// Note [Shared-memory collectives]
// Layout of the group's segment (Note [Shared segments]): a control block, one slot per rank
// (its cache line: arrival counter, pid, the fingerprints of its recent collectives), then per
// rank two staging halves of chunk_bytes each. A collective is cut into chunks; chunk k of any
// collective uses half k % 2 of every rank's staging area.
//   all_reduce, per chunk: copy in -> sync -> rank r reduces slice r of every rank's chunk, in
//     rank order 0..n-1, into its own staging -> sync -> each rank copies every slice out.
//     Every element is summed once, by one rank, in one order: replicas are bit-identical at
//     any world size (unlike one-shot schemes that sum in a rank-rotated order).
//   reduce_scatter: copy the n inputs in -> sync -> rank r reduces input r of every rank.
//   all_gather / broadcast: copy in (root only) -> sync -> copy out.
//   barrier: sync.
// Why there is no trailing sync: a rank overwrites half h only in chunk k + 2, after passing the
// first sync of chunk k + 1, which no peer reaches before it finished reading chunk k.
//
// sync(): each rank bumps its own arrival counter and waits until every counter reached the
// same value. Waiting spins for 30 us at a collective's first sync (the peers may still be
// computing) and 200 us at its later syncs (the peers are inside it: a sleep there would cost
// a wake-up, tens of microseconds on a VM, at every chunk as ranks take turns sleeping); then
// it sleeps on a futex word in the segment, waking at least every poll interval to check the
// deadline, whether another rank gave up (the abort word), and whether the ranks it waits for
// are still alive: a dead rank (no such pid, zombie, pid reused) fails the collective at once,
// a stopped one (SIGSTOP, a debugger) after kStoppedLimit. Waiting never burns the core that
// backward needs.
//
// Desync: before its first sync each collective publishes its sequence number and fingerprint
// (op, dtype, count, reduce op, root); after that sync every rank compares all of them, so
// ranks that issue different collectives fail immediately, naming both calls.
//
// Failure is final: after a timeout, a desync or a dead peer, the rank raises the abort word
// (so peers fail now instead of at their own deadline) and every later collective of the group
// fails with the first error, as a NCCL communicator does after an abort.
//
// Shared buffers (zero copy): a collective whose data lies in a SharedBuffer on every rank, at
// the same offset, moves nothing through the staging areas. all_reduce then takes two syncs:
//   publish (id, offset) -> sync -> rank r reduces slice r of every rank's buffer, in rank order,
//   and writes the result into slice r of every rank's buffer -> sync.
// Nobody reads or writes a slice but its owner between the syncs, and nobody touches a peer's
// buffer after the second one, so the collective is complete on return: the caller may write
// its buffer at once. Per rank that is one read and one write of the data: a memcpy's traffic,
// against three passes (copy in, reduce, copy out) through staging. DDP's buckets are such
// buffers (ProcessGroup::comm_buffer). When the ranks' placements differ (one rank's tensor is
// in a buffer, another's is not), every rank falls back to staging after one extra sync, so
// a mix is slower but never wrong.
//
// Execution: collectives run in issue order on the group's executor: a background thread, or
// the thread that waits for a collective the executor has not started yet (so a blocking call
// pays no thread hand-off). Issue returns at once: DDP's buckets are reduced while backward
// goes on. Whichever thread runs the queue holds exec_mu_ throughout, so the protocol's state
// (generation_, chunk_, current_, ...) is GUARDED_BY(exec_mu_); a body reaches the *_here
// steps through a std::function the analysis cannot follow, so each step opens with
// exec_mu_.assert_held().
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "base/thread_annotations.h"  // Mutex, CondVar, GUARDED_BY
#include "process_group/shm/segment.h"
#include "process_group/shm/types.h"

namespace ddp::shm {

// Bytes of each of the two staging halves per rank: both halves (512 KiB) stay in a core's L2
// between copy-in and reduction. Measured with `ddp-bench collectives` (2 ranks, 4 MiB
// float32): 256 KiB chunks 0.58 ms, 512 KiB 0.82 ms, 1 MiB 1.0-2.4 ms; below 256 KiB the syncs
// (a few microseconds each) start to dominate.
inline constexpr size_t kDefaultChunkBytes = size_t{256} << 10;
// A stopped peer (SIGSTOP, a debugger) fails the collective after this long: a job whose rank
// is frozen is as stuck as one whose rank is dead, and the user should learn which one.
inline constexpr std::chrono::seconds kStoppedLimit{3};

struct Options {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  size_t chunk_bytes = kDefaultChunkBytes;
  // How messages name each rank of this group: its rank in the process group the user sees
  // (a host's group inside the hierarchy is a subset). Empty: the ranks themselves.
  std::vector<int> names;
};

// Memory every rank of the group has mapped: rank r's part is base[r] in this process. Made
// collectively (allocate_shared_buffer in shm_setup.h), so `id` names the same allocation on
// every rank. Each rank's part is its own memfd, so the memory is counted where it is used.
struct SharedBuffer {
  uint64_t id = 0;             // allocation number within the group, from 1
  size_t bytes = 0;            // of each rank's part
  std::vector<char*> base;     // per rank, mapped in this process
  std::vector<Segment> parts;  // the mappings (own and peers'); unmapped with this object
};

// Where a collective's data lies: inside this rank's part of a shared buffer, or not (null).
struct Placement {
  std::shared_ptr<SharedBuffer> buffer;
  size_t offset = 0;  // bytes from the start of the rank's part
};

// One issued collective.
struct Op {
  uint64_t seq = 0;
  CollectiveDesc fp;           // fp.seq == seq
  Placement placement;         // all_reduce only; published so peers can find the data
  std::function<void()> body;  // runs the protocol; cleared once run
  std::atomic<bool> done{false};
  std::exception_ptr error;  // set before done
};

class Group {
 public:
  // `segment` is mapped by every rank of the group (shm_setup.cpp forms it). Records this
  // process's identity in its slot; the segment is zeroed by its creator.
  Group(Options options, Segment segment);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  // Bytes of the segment a group of `size` ranks needs.
  static size_t segment_bytes(int size, size_t chunk_bytes);

  int rank() const { return o_.rank; }
  int name(int r) const { return o_.names.empty() ? r : o_.names[r]; }  // for messages
  int me() const { return name(o_.rank); }
  // Why rank `peer` can take part in nothing more: it destroyed its group, or its process is
  // gone (exited, killed, its pid reused); "" while it may (running, stopped, or a thread of this
  // process). From any thread (the slots are atomics): the mailbox's recv asks it while it waits.
  std::string peer_gone(int peer) const;
  int size() const { return o_.size; }
  std::chrono::milliseconds timeout() const { return o_.timeout; }

  // Shared buffers made for this group: registered so that find() recognises their memory.
  void register_buffer(const std::shared_ptr<SharedBuffer>& buffer) EXCLUDES(buffers_mu_);
  // The shared buffer holding [data, data + bytes) in this rank's part, if any.
  Placement find(const void* data, size_t bytes) const EXCLUDES(buffers_mu_);

  // The collectives, on plain memory. Each returns at once; `keep` holds whatever must stay
  // alive until the collective ran (the tensors). Pointers must stay valid until then.
  // all_reduce moves nothing through staging when `placement` names a shared buffer holding
  // `data` (see Shared buffers above).
  std::shared_ptr<Op> all_reduce(uint64_t seq, void* data, size_t count, DType dtype, Reduce op,
                                 std::shared_ptr<void> keep, Placement placement = {});
  std::shared_ptr<Op> broadcast(uint64_t seq, void* data, size_t count, DType dtype, int root,
                                std::shared_ptr<void> keep);
  // outputs[r] receives rank r's input (count elements each).
  std::shared_ptr<Op> all_gather(uint64_t seq, std::vector<void*> outputs, const void* input,
                                 size_t count, DType dtype, std::shared_ptr<void> keep);
  // output = reduction over ranks of their inputs[rank()] (count elements each).
  std::shared_ptr<Op> reduce_scatter(uint64_t seq, void* output, std::vector<const void*> inputs,
                                     size_t count, DType dtype, Reduce op,
                                     std::shared_ptr<void> keep);
  std::shared_ptr<Op> barrier(uint64_t seq);

  // A collective composed by the caller (the hierarchical transport: shm steps around a
  // cross-host one): `body` runs in issue order like any collective and may call the *_here
  // steps below, which every peer's body must call in the same order. Exceptions it throws
  // fail the op and, like any failure, the group.
  std::shared_ptr<Op> run(uint64_t seq, CollectiveDesc fp, std::function<void()> body,
                          Placement placement = {});
  // Steps of the op being run; only from inside a body, whose thread holds exec_mu_ (each
  // asserts it to the analysis: the body is a std::function it cannot follow).
  void all_reduce_here(void* data, size_t count, DType dtype, Reduce op,
                       const Placement& placement);
  void broadcast_here(void* data, size_t bytes, int root);
  // outputs[r] receives rank r's `bytes` from `input` (outputs[rank()] may be `input`).
  void all_gather_here(const std::vector<void*>& outputs, const void* input, size_t bytes);
  // output = reduction over ranks of their inputs[rank()] (count elements each).
  void reduce_scatter_here(void* output, const std::vector<const void*>& inputs, size_t count,
                           DType dtype, Reduce op);
  void barrier_here();
  // Gives the rest of the op a fresh timeout (after a step that waited elsewhere).
  void restart_deadline();

  // Blocks until `op` ran (running it, and the ones before it, on this thread when the
  // executor has not started it yet); rethrows its ddp::Error. Never from inside a body.
  void wait(Op& op) EXCLUDES(exec_mu_, mu_);

 private:
  struct Control;
  struct Slot;

  std::shared_ptr<Op> submit(uint64_t seq, CollectiveDesc fp, std::function<void()> body,
                             Placement placement = {}) EXCLUDES(mu_);
  void executor_loop() EXCLUDES(exec_mu_, mu_);
  void run_front() REQUIRES(exec_mu_) EXCLUDES(mu_);  // runs the oldest queued op
  void set_helping(bool helping) EXCLUDES(mu_);
  void execute(Op& op) REQUIRES(exec_mu_);

  // Protocol (the thread running the queue).
  void begin(const Op& op) REQUIRES(exec_mu_);
  void staged_all_reduce(char* data, size_t count, DType dtype, Reduce op, bool synced_once)
      REQUIRES(exec_mu_);
  void shared_all_reduce(const Placement& where, size_t count, DType dtype, Reduce op)
      REQUIRES(exec_mu_);
  // Every rank published `mine`'s id and offset.
  bool placed_alike(const Placement& mine) const REQUIRES(exec_mu_);
  bool any_peer_placed() const REQUIRES(exec_mu_);  // some rank published a shared buffer
  int next_half() REQUIRES(exec_mu_) { return static_cast<int>(chunk_++ & 1); }
  char* staging(int rank, int half) const;
  void sync() REQUIRES(exec_mu_);
  bool all_arrived(uint64_t generation) const;
  void wait_for_all(uint64_t generation) REQUIRES(exec_mu_);
  void check_fingerprints() REQUIRES(exec_mu_);
  void check_peers(uint64_t generation, std::chrono::steady_clock::time_point now)
      REQUIRES(exec_mu_);
  void check_abort() const REQUIRES(exec_mu_);
  [[noreturn]] void fail_timeout(uint64_t generation) REQUIRES(exec_mu_);
  void raise_abort(const std::string& reason);
  // "rank 1 is in broadcast #7 (...)"
  std::string where_is(int peer) const REQUIRES(exec_mu_);

  // Constant after construction.
  const Options o_;
  Segment segment_;
  Control* ctl_ = nullptr;
  std::vector<Slot*> slots_;
  const int pid_;

  // Executor state: held by the thread running the queue (the executor, or a waiter helping),
  // for as long as it runs ops; taken with try_lock(), never waited for.
  Mutex exec_mu_;
  uint64_t generation_ GUARDED_BY(exec_mu_) = 0;  // syncs passed by this rank
  uint64_t chunk_ GUARDED_BY(exec_mu_) = 0;       // chunks moved (selects the staging half)
  const Op* current_ GUARDED_BY(exec_mu_) = nullptr;
  bool fingerprints_checked_ GUARDED_BY(exec_mu_) = false;
  // When the current op began.
  std::chrono::steady_clock::time_point started_ GUARDED_BY(exec_mu_);
  // started_ + timeout, or later if restarted.
  std::chrono::steady_clock::time_point deadline_ GUARDED_BY(exec_mu_);
  // Per rank; zero = running.
  std::vector<std::chrono::steady_clock::time_point> stopped_since_ GUARDED_BY(exec_mu_);
  // The first error: every later collective fails with it.
  std::exception_ptr failed_ GUARDED_BY(exec_mu_);
  std::string failed_message_ GUARDED_BY(exec_mu_);

  // Shared buffers by the address of this rank's part.
  mutable Mutex buffers_mu_;
  std::map<uintptr_t, std::weak_ptr<SharedBuffer>> buffers_ GUARDED_BY(buffers_mu_);

  // The queue of issued ops.
  Mutex mu_;
  CondVar queued_{&mu_};  // an op was queued, or stopping_
  CondVar done_{&mu_};    // an op finished, or helping_ ended, or stopping_
  std::deque<std::shared_ptr<Op>> queue_ GUARDED_BY(mu_);
  bool helping_ GUARDED_BY(mu_) =
      false;  // a waiting thread runs the queue (the executor stands aside)
  bool stopping_ GUARDED_BY(mu_) = false;

  std::thread executor_;  // last: starts after everything above exists
};

}  // namespace ddp::shm
