// DistributedDataParallel: every rank holds a replica; after backward() every rank holds the
// mean of all ranks' gradients, reduced in buckets while backward is still running.
//
//   auto net = std::make_shared<Net>();
//   ddp::DistributedDataParallel model(net, {.bucket_cap_mb = 25});
//   torch::optim::SGD opt(model.parameters(), 0.1);
//   auto loss = torch::nll_loss(model(x), y);   // forward through the wrapper
//   loss.backward();                            // bucketed all-reduce overlaps backward
//   opt.step();
//
// Names, options and defaults follow PyTorch's torch.nn.parallel.DistributedDataParallel, so
// code ports line by line. How it works: a hook on each parameter's gradient marks it ready;
// a bucket (gradients in reverse registration order, bucket_cap_mb each) is all-reduced as
// soon as its last gradient is ready, while backward goes on; the end of backward waits for
// every bucket and writes the averages into .grad. After the first iteration the buckets are
// rebuilt once in the order the gradients arrived (bucket_order()).
//
// Construction (with init_sync) is a collective: every rank must construct its wrapper, with
// the same parameters (count, names, shapes, dtypes) registered in the same order; rank 0's
// parameters and buffers are then copied to every rank. Each forward through the wrapper is
// followed by at most one backward; calling backward twice per forward is an error (the second
// would not be reduced), as is a parameter that gets no gradient unless find_unused_parameters
// or static_graph says that may happen.
//
// Thread-safety: one wrapper is driven by one training thread.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "ddp/comm_hooks.h"
#include "ddp/process_group.h"

namespace ddp {

inline constexpr double kDefaultBucketCapMb = 25;        // PyTorch's default
inline constexpr double kDefaultFirstBucketMb = 1;       // PyTorch's kDefaultFirstBucketBytes
inline constexpr double kDefaultBroadcastChunkMb = 250;  // PyTorch's coalesced broadcast chunk

struct DDPOptions {
  // The group to reduce over; null means the default group (init_process_group()).
  std::shared_ptr<ProcessGroup> process_group;
  // Copy rank 0's buffers (e.g. BatchNorm running stats) to every rank at each forward.
  bool broadcast_buffers = true;
  // Target bucket size. Small values force many buckets (useful in tests).
  double bucket_cap_mb = kDefaultBucketCapMb;
  // Size of the first bucket of each dtype: small, so the first all-reduce starts early.
  double first_bucket_mb = kDefaultFirstBucketMb;
  // Parameters may get no gradient in an iteration (on some or all ranks).
  bool find_unused_parameters = false;
  // Parameters' .grad tensors are views into the buckets: no copy in or out, one less copy of
  // the gradients in memory. Optimizers must not replace .grad (zero_grad() is fine).
  bool gradient_as_bucket_view = false;
  // The set of used parameters and how often each gets a gradient never changes: recorded in
  // the first iteration and reused (allows unused parameters and reentrant checkpointing).
  bool static_graph = false;
  // Verify parameters across ranks and copy rank 0's parameters and buffers at construction.
  bool init_sync = true;
  // PyTorch's device_ids: for a module on one CUDA device, that device's index ({LOCAL_RANK},
  // as in DistributedDataParallel(model, device_ids=[local_rank])); checked at construction:
  // every parameter and buffer must be on it. Unset (or empty): the module stays wherever it
  // is (CPU modules; CUDA modules whose device was chosen otherwise). One entry at most.
  std::vector<int> device_ids;
  // Unset: DDP_DEBUG (off|info|detail), else TORCH_DISTRIBUTED_DEBUG, else off. info logs the
  // bucket layout; detail also logs, per iteration, the order in which parameters were ready.
  std::optional<DebugLevel> debug;
};

// Timings of the last reduced iteration (seconds, from the first gradient hook of backward).
struct IterationStats {
  std::vector<double> bucket_launch_s;   // when each bucket's communication started
  double last_gradient_s = 0;            // when the last parameter's gradient was ready
  double finalize_start_s = 0;           // when backward's end-of-graph callback ran
  double finalize_end_s = 0;             // when all buckets were reduced and written back
  std::vector<std::string> ready_order;  // parameter names in the order they were ready
};

class DistributedDataParallelBase;
class Join;

namespace detail {
class DdpCore;  // the machinery behind the wrapper: the library's
DdpCore& core_of(DistributedDataParallelBase& model);  // for the library's own components
}  // namespace detail

// While it lives, backward passes through the wrapper do not reduce gradients (see no_sync()).
class NoSyncGuard {
 public:
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  friend class DistributedDataParallelBase;
  NoSyncGuard(detail::DdpCore& core, bool enabled);
  detail::DdpCore& core_;
  bool previous_;
};

// Everything a DistributedDataParallel<M> offers that does not depend on M (ddp::Join takes
// any wrapper through it).
class DistributedDataParallelBase {
 public:
  DistributedDataParallelBase(const DistributedDataParallelBase&) = delete;
  DistributedDataParallelBase& operator=(const DistributedDataParallelBase&) = delete;

  // While the returned guard lives (and `enabled` is true), gradients accumulate locally; the
  // next backward after it (its forward outside the guard) reduces the accumulated sum:
  //   { auto guard = model.no_sync(); for (micro 1..K-1) model(x).backward(); }
  //   model(x_K).backward();   // reduces the sum of all K micro-batches
  // no_sync(false) returns a guard that changes nothing, for code that decides at run time:
  //   auto guard = model.no_sync(/*enabled=*/micro < K - 1);
  [[nodiscard]] NoSyncGuard no_sync(bool enabled = true);

  // Before the first forward, on every rank (comm_hooks.h).
  void register_comm_hook(CommHook hook);

  ProcessGroup& process_group();
  // The wrapped module without its type (DistributedDataParallel<M>::module() gives it typed).
  torch::nn::Module& untyped_module() const;
  const IterationStats& last_iteration_stats() const;
  std::vector<std::vector<std::string>> bucket_layout() const;
  // The parameter order (indices in registration order) the buckets were rebuilt in after the
  // first iteration (the observed gradient order); empty before that rebuild, when there is
  // none (find_unused_parameters), and at world size 1. Save it with a checkpoint and restore
  // it (every rank, before the first forward) so that a resumed run reduces in the same
  // buckets, hence bit for bit the same sums, from its first step. Restoring an empty order
  // does nothing.
  std::vector<int64_t> bucket_order() const;
  void restore_bucket_order(const std::vector<int64_t>& order);

 protected:
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module, DDPOptions options);
  ~DistributedDataParallelBase();
  DistributedDataParallelBase(DistributedDataParallelBase&&) noexcept;
  DistributedDataParallelBase& operator=(DistributedDataParallelBase&&) noexcept;
  void before_forward();

  // A tensor argument of forward on DDPOptions::device_ids' device: the argument itself, or its
  // copy there (held until the next forward, so a reference to it stays valid).
  template <typename T>
  T&& on_input_device(T&& arg) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      if (at::Tensor* moved = to_input_device(arg)) return static_cast<T&&>(*moved);
    }
    return std::forward<T>(arg);
  }

 private:
  friend class Join;  // drives the wrapper's rounds (ddp/join.h)
  friend detail::DdpCore& detail::core_of(DistributedDataParallelBase& model);
  // Null when `t` is undefined, already there, or no device_ids was given.
  at::Tensor* to_input_device(const at::Tensor& t);
  std::unique_ptr<detail::DdpCore> core_;
  std::optional<c10::Device> input_device_;  // device_ids[0] as a CUDA device
  std::deque<at::Tensor> moved_inputs_;      // this forward's copies (deque: stable addresses)
};

template <typename ModuleType>
class DistributedDataParallel : public DistributedDataParallelBase {
 public:
  DistributedDataParallel(std::shared_ptr<ModuleType> module, DDPOptions options = {})
      : DistributedDataParallelBase(module, std::move(options)), module_(std::move(module)) {}
  DistributedDataParallel(torch::nn::ModuleHolder<ModuleType> holder, DDPOptions options = {})
      : DistributedDataParallel(holder.ptr(), std::move(options)) {}

  // Forward through the wrapper: broadcasts buffers, prepares gradient reduction, then calls
  // the module's own forward with whatever arguments it takes. With device_ids, tensor
  // arguments elsewhere are first copied to that device (non_blocking), as PyTorch's DDP does.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    before_forward();
    return module_->forward(on_input_device(std::forward<Args>(args))...);
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // The wrapped module: what users save and evaluate.
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  ModuleType* operator->() const { return module_.get(); }
  std::vector<at::Tensor> parameters(bool recurse = true) const {
    return module_->parameters(recurse);
  }
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const {
    return module_->named_parameters(recurse);
  }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }

 private:
  std::shared_ptr<ModuleType> module_;
};

template <typename M>
DistributedDataParallel(std::shared_ptr<M>, DDPOptions = {}) -> DistributedDataParallel<M>;
template <typename M>
DistributedDataParallel(torch::nn::ModuleHolder<M>, DDPOptions = {}) -> DistributedDataParallel<M>;

}  // namespace ddp
