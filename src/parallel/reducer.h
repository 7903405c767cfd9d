// The reducer: gradient buckets, autograd hooks, overlapped all-reduce, write-back.
//
// Note [Reducer]
// One iteration = one forward through DDP (prepare_for_forward) + one backward:
//   1. A post-hook on each parameter's AccumulateGrad node fires once its gradient is
//      accumulated. The first hook of the iteration queues finalize() on the autograd engine,
//      to run when the whole backward graph has executed.
//   2. The hook marks the parameter ready: its gradient is copied into its slot of a flat bucket
//      (or already is that slot, with gradient_as_bucket_view). When a bucket's last parameter
//      is ready, the bucket is ready.
//   3. Buckets are launched strictly in bucket order (a ready bucket waits for the ones before
//      it), so every rank issues the same collectives in the same order even though ready
//      orders can differ across ranks. Launching calls the comm hook (default: divide by the
//      world size and all-reduce asynchronously): communication runs while backward continues.
//   4. finalize(): parameters that got no gradient are marked ready now (with
//      find_unused_parameters / static_graph; otherwise this is the error naming them), the
//      remaining buckets launch, every bucket's Future is waited for in order, and the averaged
//      values are written back to .grad (nothing to write with gradient_as_bucket_view).
//      With find_unused_parameters, a bitmap of which parameters were used anywhere is
//      all-reduced too: parameters used by no rank keep their .grad untouched, as in PyTorch.
//   5. After the first reduced iteration, buckets are rebuilt once in the order gradients were
//      actually ready (rank 0's order, broadcast, so all ranks agree) — unless the set of used
//      parameters may change (find_unused_parameters without static_graph).
// static_graph: the first iteration only counts hook firings per parameter (no overlap); later
// iterations expect the same counts (reentrant checkpointing fires a hook several times) and
// mark the recorded unused parameters ready at the first hook.
// no_sync: forwards under the guard prepare nothing; hooks ignore the iteration and gradients
// simply accumulate in .grad, to be reduced by the next synced backward.
// World size 1 with the default hook: the mean over one rank is the local gradient, so hooks
// return at once and no bucket memory is allocated (a registered comm hook turns this off:
// its numerics, e.g. fp16 rounding, apply at any world size).
//
// Locking: every entry point takes mu_ (autograd may run hooks on device threads). The comm
// hook is user code and runs with mu_ held, and so do the collectives of the bucket rebuild and
// of finalize; a hook that calls back into the reducer (a forward through the wrapper, its
// bucket layout...) would deadlock on mu_, so every entry point first checks that this thread
// is not inside a hook and throws ddp::Error naming the call instead.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "base/thread_annotations.h"
#include "ddp/comm_hooks.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"

namespace torch::autograd {
struct Node;
}

namespace ddp::detail {

// The wrapper's options, whole (a new DDPOptions field reaches the reducer without a copy to
// update), and what the wrapper resolved from them.
struct ReducerOptions {
  DDPOptions ddp;
  DebugLevel debug = DebugLevel::kOff;  // ddp.debug, else DDP_DEBUG

  int64_t first_bucket_bytes() const { return megabytes(ddp.first_bucket_mb); }
  int64_t bucket_bytes() const { return megabytes(ddp.bucket_cap_mb); }
  static int64_t megabytes(double mb) { return static_cast<int64_t>(mb * 1024 * 1024); }
};

class Reducer {
 public:
  // `params` require grad and are leaves; `names` name them in messages.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, ProcessGroup& group,
          ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called at each forward through DDP; `sync` false under no_sync(). May run one collective
  // (the bucket rebuild after the first iteration).
  void prepare_for_forward(bool sync);
  void register_comm_hook(CommHook hook);
  // What built-in hooks divide the bucket sums by in the coming iterations (default: the
  // world size; ddp::Join sets the number of ranks still training).
  void set_divisor(int divisor);
  // For a rank that has joined (ran out of data), after prepare_for_forward(true): issues
  // exactly the collectives of the others' synced backward (every bucket through the comm
  // hook, the used-parameter bitmap), contributing zeros, and waits for them. Gradients are
  // untouched.
  void shadow_backward();
  const IterationStats& last_stats() const { return last_stats_; }
  std::vector<std::vector<std::string>> layout() const;
  // The parameter order the buckets were rebuilt in (the observed ready order); empty until
  // that one-time rebuild happened, or when it never does (find_unused_parameters): then a
  // resumed process does exactly what the original did anyway. Saved in checkpoints so that
  // a resumed process uses the same buckets, hence the same summation order, from its first
  // step.
  std::vector<int64_t> bucket_order() const;
  // Rebuilds the buckets from a saved order now (and skips the one-time rebuild). Every rank
  // must restore the same order. Throws ddp::Error if it is not a permutation of the
  // parameters or an iteration is under way.
  void restore_bucket_order(const std::vector<int64_t>& order);
  // Reduces over `group` from now on (fault tolerance: the replicas re-formed in process, Note
  // [Per-step fault tolerance]). Between iterations, on every rank of `group`: forgets an
  // iteration the old group failed in, divides by the new size, and builds the buckets again
  // in the same order (or the one restore_bucket_order() gives before then) in the new
  // transport's memory at the next forward. The one-time bucket rebuild and the static graph's
  // recording start over unless the buckets were rebuilt already.
  void rebind(ProcessGroup& group);

 private:
  struct Bucket;
  enum class Phase { kIdle, kForwarded, kBackward, kFinalized };

  void on_gradient(size_t var) EXCLUDES(mu_);
  void begin_backward() REQUIRES(mu_);
  void mark_ready(size_t var) REQUIRES(mu_);
  void launch_ready_buckets() REQUIRES(mu_);
  void finalize() EXCLUDES(mu_);
  // Throws ddp::Error when this thread is running the comm hook (Locking, above).
  void check_not_in_hook(const char* call) const;
  void finalize_locked() REQUIRES(mu_);
  bool needs_used_bitmap() const REQUIRES(mu_);
  void launch_bucket(size_t b) REQUIRES(mu_);
  std::vector<size_t> handle_missing_gradients() REQUIRES(mu_);
  // The reduced values of `vars` into their .grad (not those used by no rank).
  void write_back(const std::vector<size_t>& vars, const std::vector<char>& globally_unused)
      REQUIRES(mu_);
  std::vector<size_t> initial_order() const;
  void build_initial_buckets() REQUIRES(mu_);
  void build_buckets(const std::vector<size_t>& order) REQUIRES(mu_);
  void maybe_rebuild_buckets() REQUIRES(mu_);
  void log_layout(const char* when) const REQUIRES(mu_);
  double since_start() const REQUIRES(mu_);
  void fail_iteration() REQUIRES(mu_);
  void settle_rebind() REQUIRES(mu_);  // the buckets of a rebind(), built now

  // Constant after construction.
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  ProcessGroup* group_ GUARDED_BY(mu_);  // rebind() changes it
  std::atomic<int> rank_;                // group_'s rank, for messages made without mu_
  const ReducerOptions options_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep hooks alive
  std::vector<uintptr_t> hook_keys_;

  // The thread running the comm hook, while it runs (Locking, above).
  std::atomic<std::thread::id> hook_thread_{};

  mutable Mutex mu_;  // hooks may run on autograd device threads
  CommHook hook_ GUARDED_BY(mu_);
  bool custom_hook_ GUARDED_BY(mu_) = false;  // register_comm_hook() was called
  std::vector<Bucket> buckets_ GUARDED_BY(mu_);
  struct Location {
    size_t bucket = 0;
    size_t slot = 0;
  };
  std::vector<Location> location_ GUARDED_BY(mu_);  // per parameter
  bool passthrough_ GUARDED_BY(mu_) = false;        // world size 1, default hook: nothing to reduce
  int divisor_ GUARDED_BY(mu_) = 1;                 // see set_divisor()
  Phase phase_ GUARDED_BY(mu_) = Phase::kIdle;
  bool sync_ GUARDED_BY(mu_) = false;
  std::vector<int> fired_ GUARDED_BY(mu_);          // hook firings this iteration, per parameter
  std::vector<char> ready_ GUARDED_BY(mu_);         // marked ready this iteration, per parameter
  std::vector<size_t> hook_order_ GUARDED_BY(mu_);  // in the order their hooks first fired
  size_t next_launch_ GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point start_ GUARDED_BY(mu_);
  IterationStats stats_ GUARDED_BY(mu_);
  // Read by last_stats() without the lock: written only at the end of finalize, on the
  // training thread that reads it.
  IterationStats last_stats_;
  int64_t iterations_ GUARDED_BY(mu_) = 0;  // reduced iterations so far
  bool rebuilt_ GUARDED_BY(mu_) = false;
  // After rebind(), until the next forward: the order to build the buckets in (Note above).
  std::optional<std::vector<size_t>> pending_order_ GUARDED_BY(mu_);
  std::vector<size_t> first_hook_order_ GUARDED_BY(mu_);  // from the first reduced iteration
  // static_graph, recorded in the first reduced iteration:
  bool recorded_ GUARDED_BY(mu_) = false;
  std::vector<int> expected_fires_ GUARDED_BY(mu_);
  std::vector<char> recorded_globally_unused_ GUARDED_BY(mu_);
};

}  // namespace ddp::detail
