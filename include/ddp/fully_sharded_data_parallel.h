// FullyShardedDataParallel: each rank keeps 1/world of every parameter, of its gradient and of
// the optimizer's state between steps, for models whose DDP replica does not fit a device.
//
//   auto net = std::make_shared<Net>();                 // fc1, fc2, fc3 submodules
//   ddp::FullyShardedDataParallel model(net);           // a unit per child: fc1, fc2, fc3
//   torch::optim::Adam opt(model.parameters(), 1e-3);   // this rank's shards, one per unit
//   auto loss = torch::nll_loss(model(x), y);           // every unit's parameters gathered
//   loss.backward();       // each unit's gradient reduce-scattered as soon as it is complete
//   opt.step();            // steps the shards; the next forward gathers them again
//
// Names follow PyTorch's FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel): a *unit* is a
// wrapped submodule whose parameters are flattened into one flat parameter, padded to a multiple
// of the world size and split into equal shards, rank r keeping shard r (Note [FSDP units] in
// src/parallel/fsdp.cpp). Between steps each parameter of the module is a 1-D view of the part
// of it that lies in this rank's shard (possibly empty), as FSDP1's use_orig_params shows them;
// full_parameters() gathers them whole.
//
// Strategies:
//   - ShardingStrategy::kShardGradOp (ZeRO-2, PyTorch's SHARD_GRAD_OP): the forward gathers every
//     unit's parameters (the all-gathers all in flight at once), keeps them through the backward
//     and frees them when it ends;
//   - ShardingStrategy::kFullShard (ZeRO-3, PyTorch's FULL_SHARD): a unit's parameters are
//     gathered when its forward starts (the next unit's all-gather already in flight), freed
//     when it returns, gathered again when the backward reaches it (the next one's prefetched)
//     and freed once its gradient is reduce-scattered. LibTorch's C++ modules have no forward
//     hooks, so such a unit is a ddp::Sharded<M> in the model (below): its forward is the hook.
// Either way the backward reduce-scatters each unit's gradient in reverse unit order while it
// goes on, so each rank holds the average gradient of its shard only.
// Mixed precision (FSDPOptions::mixed_precision, PyTorch's FSDP1 MixedPrecision): the shards
// stay in their own precision (fp32) and the optimizer steps them there; each gather casts this
// rank's shard to param_dtype (bf16, fp16) and all-gathers that, so the forward and backward
// compute in param_dtype and the gathered units take half the memory and half the bytes on the
// wire; gradients are reduce-scattered in reduce_dtype and added to the shards' fp32 .grad.
// Checkpoints hold each rank's part of each parameter (local_shards()), in each rank's own file
// (a sharded checkpoint) or joined whole, and load at any world size (ddp/training_state.h,
// ddp/checkpoint.h).
//
// ZeRO-3 units in a model:
//   struct NetImpl : torch::nn::Module {
//     ddp::Sharded<torch::nn::LinearImpl> fc1{nullptr}, fc2{nullptr};
//     NetImpl() {
//       fc1 = register_module("fc1", ddp::Sharded<torch::nn::LinearImpl>(784, 1024));
//       fc2 = register_module("fc2", ddp::Sharded<torch::nn::LinearImpl>(1024, 10));
//     }
//     at::Tensor forward(at::Tensor x) { return fc2(torch::relu(fc1(x))); }
//   };
//   ddp::FullyShardedDataParallel model(net, {.sharding_strategy = ddp::ShardingStrategy::kFullShard});
// A Sharded<M> holds its M as the child "module" (FSDP1's wrapped module); full_parameters()
// names parameters without it ("fc1.weight"). Outside a FullyShardedDataParallel it is M.
//
// Under mixed precision the module's parameters are param_dtype tensors (their gradients too);
// between steps each holds this rank's part as cast at the last gather (or load), so the
// optimizer's last step shows only from the next forward: read the true values from
// parameters(), local_shards() or full_parameters(), which are in the shards' precision.
//
// Construction is a collective (every rank, the same module structure); with sync_module_states
// rank 0's parameters go to every rank. Every parameter of a unit must have one dtype and
// device. A unit's parameters that get no gradient in a backward count as zeros, on every rank,
// so every rank always issues the same reduce-scatters. Each forward is followed by at most one
// backward. Buffers are rank 0's after construction (sync_module_states) and then stay per rank,
// as in PyTorch's FSDP, which has no broadcast_buffers: BatchNorm's running stats are each rank's.
//
// Lifetime: the module's parameters stay shard views after the wrapper is destroyed (gathering
// them back would be a collective in a destructor); take full_parameters() first to keep them.
//
// Thread-safety: one wrapper is driven by one training thread.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "ddp/process_group.h"

namespace ddp {

enum class ShardingStrategy {
  // ZeRO-2 (PyTorch's SHARD_GRAD_OP): parameters gathered for forward and backward, freed after.
  kShardGradOp,
  // ZeRO-3 (PyTorch's FULL_SHARD): each ddp::Sharded unit gathered for its forward and again for
  // its backward, freed after each. Units that are not Sharded are gathered as in ZeRO-2.
  kFullShard,
};

// What FSDP computes and communicates in (PyTorch's FSDP1 MixedPrecision). Unset: as the
// parameters are (no mixed precision).
struct MixedPrecision {
  // The gathered parameters' dtype, in which the forward and backward compute (and their
  // gradients come); the shards and the optimizer stay in the parameters' own dtype.
  std::optional<at::ScalarType> param_dtype;
  // The dtype gradients are reduce-scattered in (fp32: exact sums of low-precision gradients);
  // unset: param_dtype, as PyTorch's.
  std::optional<at::ScalarType> reduce_dtype;
  // The floating-point buffers (BatchNorm's statistics) cast to this at construction and kept
  // so (LibTorch 1.13's CPU BatchNorm wants its buffers in the input's dtype); unset: kept.
  std::optional<at::ScalarType> buffer_dtype;
  // The wrapper's and each Sharded unit's floating-point tensor inputs cast to param_dtype
  // (PyTorch's cast_forward_inputs / cast_root_forward_inputs).
  bool cast_forward_inputs = true;
};

struct FSDPOptions {
  // The group to shard over; null means the default group (init_process_group()).
  std::shared_ptr<ProcessGroup> process_group;
  ShardingStrategy sharding_strategy = ShardingStrategy::kShardGradOp;
  // The units: submodules of the wrapped module whose parameters are sharded, gathered and
  // reduced together (FSDP1's wrapped submodules). Every ddp::Sharded submodule is one as well.
  // A parameter inside several (nested) units belongs to the innermost. Empty, and no Sharded
  // submodule: one unit per direct child that has parameters. Parameters no unit holds form the
  // root unit.
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  // Copy rank 0's parameters and buffers to every rank at construction (PyTorch's
  // sync_module_states).
  bool sync_module_states = true;
  MixedPrecision mixed_precision;
};

// What a rank holds of the parameters (bytes), for memory reports.
struct FSDPMemoryStats {
  // This rank's shards: all it keeps between steps (plus their .grad), with their param_dtype
  // copies under mixed precision.
  int64_t shard_bytes = 0;
  int64_t full_bytes = 0;   // every unit whole: what each rank of DDP keeps
  // The most parameter bytes gathered at once since construction or the last reset: every unit
  // under ZeRO-2; under ZeRO-3 the non-Sharded units and at most a Sharded unit or two (the one
  // computing and the one prefetched).
  int64_t peak_gathered_bytes = 0;
  // Freed flat buffers kept for the next step (CPU: at most the units gathered for the whole
  // step, every unit under ZeRO-2, plus four of the largest), so that a step maps no new memory
  // (Note [FSDP buffers] in src/parallel/fsdp_buffers.h).
  int64_t cached_bytes = 0;
};

namespace detail {
class FsdpCore;

// What FullyShardedDataParallel sees of a ddp::Sharded unit.
class ShardedBase : public torch::nn::Module {
 public:
  // Before the wrapped module's forward: its parameters gathered (a no-op when not bound).
  void before_unit_forward();
  // After it: `out` marked so that its backward gathers them again; freed (ZeRO-3).
  at::Tensor after_unit_forward(at::Tensor out);
  // After a forward that threw: back to the shards.
  void unit_forward_failed() noexcept;
  // `input` cast to the mixed precision's param_dtype when it asks for that.
  at::Tensor cast_input(const at::Tensor& input) const;

 private:
  friend class FsdpCore;
  FsdpCore* core_ = nullptr;  // set by the FullyShardedDataParallel that holds it
  size_t unit_ = 0;
};
}  // namespace detail

// A ZeRO-3 unit: M, whose parameters a FullyShardedDataParallel gathers when its forward starts
// and frees when it returns (Note [FSDP units]). Use Sharded<M> where M would go; its forward
// takes one tensor and returns one, as M's must (a module taking more: wrap its parts).
template <typename M>
class ShardedImpl : public detail::ShardedBase {
 public:
  template <typename... Args>
  explicit ShardedImpl(Args&&... args)
      : module(register_module("module", std::make_shared<M>(std::forward<Args>(args)...))) {}
  explicit ShardedImpl(torch::nn::ModuleHolder<M> holder)
      : module(register_module("module", holder.ptr())) {}

  at::Tensor forward(const at::Tensor& input) {
    before_unit_forward();
    at::Tensor out;
    try {
      out = module->forward(cast_input(input));
    } catch (...) {
      unit_forward_failed();
      throw;
    }
    return after_unit_forward(std::move(out));
  }

  std::shared_ptr<M> module;
};

template <typename M>
class Sharded : public torch::nn::ModuleHolder<ShardedImpl<M>> {
 public:
  using torch::nn::ModuleHolder<ShardedImpl<M>>::ModuleHolder;
};

class FullyShardedDataParallelBase;

// While it lives (and was made enabled), backward passes keep their full gradients on the
// parameters, summed, and reduce nothing; the first backward after it reduce-scatters the sum
// (PyTorch's FSDP no_sync: gradient accumulation without communication, at the memory of full
// gradients). Every rank must use it for the same micro-batches.
class FSDPNoSyncGuard {
 public:
  ~FSDPNoSyncGuard();
  FSDPNoSyncGuard(const FSDPNoSyncGuard&) = delete;
  FSDPNoSyncGuard& operator=(const FSDPNoSyncGuard&) = delete;

 private:
  friend class FullyShardedDataParallelBase;
  FSDPNoSyncGuard(detail::FsdpCore& core, bool enabled);
  detail::FsdpCore& core_;
  bool previous_;
};

class FullyShardedDataParallelBase {
 public:
  FullyShardedDataParallelBase(const FullyShardedDataParallelBase&) = delete;
  FullyShardedDataParallelBase& operator=(const FullyShardedDataParallelBase&) = delete;
  virtual ~FullyShardedDataParallelBase();

  // This rank's shards, one flat tensor per unit: what the optimizer steps.
  std::vector<at::Tensor> parameters() const;
  // Every parameter of the module, whole, by name, on every rank (a collective; outside a
  // forward-backward): PyTorch's FULL_STATE_DICT of the parameters.
  std::vector<std::pair<std::string, at::Tensor>> full_parameters();
  // The same one unit at a time, without the copies: each(name, whole) for every parameter, the
  // tensor valid during the call only (its unit is freed after it). Copy what you keep: a rank
  // then needs one unit whole beyond its shards, where full_parameters() needs the whole model
  // (saving a model that does not fit twice). A collective, as full_parameters().
  using FullParameterVisitor = std::function<void(const std::string&, const at::Tensor&)>;
  void for_each_full_parameter(const FullParameterVisitor& each);
  // The other way: each rank takes its shards from whole parameters by name (full_parameters()'
  // names and shapes, saved at any world size). Not a collective. check_full_parameters() says
  // why they do not fit ("" when they do); load_full_parameters() throws IncompatibleStateError
  // then, changing nothing. A checkpoint does both through TrainingState::add(key, model).
  std::string check_full_parameters(
      const std::vector<std::pair<std::string, at::Tensor>>& full) const;
  void load_full_parameters(const std::vector<std::pair<std::string, at::Tensor>>& full);
  // This rank's part of every parameter, by full_parameters()' name (PyTorch's
  // SHARDED_STATE_DICT, as flat pieces): the parameter's whole shape, where the part starts in
  // it (row-major), and a 1-D view of the part inside this rank's shard (parameters()[unit],
  // from element shard_offset), empty where the rank holds none of it. Writing into a view
  // (under NoGradGuard) writes the shard. Not a collective; call it between steps. A checkpoint
  // saves these through TrainingState::add.
  struct LocalShard {
    std::string name;
    std::vector<int64_t> shape;
    int64_t offset = 0;
    at::Tensor data;
    size_t unit = 0;
    int64_t shard_offset = 0;
  };
  std::vector<LocalShard> local_shards();
  // The module's buffers (BatchNorm's running statistics) by full_parameters()-style name
  // (without a Sharded unit's "module."). They are not sharded, and not synchronised after
  // construction (sync_module_states copies rank 0's): each rank keeps its own from then on
  // (PyTorch's FSDP does the same), and a checkpoint saves each rank's.
  std::vector<std::pair<std::string, at::Tensor>> named_buffers() const;
  // The units in forward order: a name ("fc1", or "(root)") and how many parameters it holds.
  std::vector<std::pair<std::string, size_t>> units() const;
  FSDPMemoryStats memory_stats() const;
  void reset_peak_memory_stats();
  [[nodiscard]] FSDPNoSyncGuard no_sync(bool enabled = true);
  // torch::nn::utils::clip_grad_norm_ over the whole model's gradients, which the ranks hold in
  // shards (a collective, after the backward): scales every shard's gradient by
  // max_norm / (norm + 1e-6) when that is below 1; returns the norm before clipping (2-norm).
  double clip_grad_norm_(double max_norm);
  ProcessGroup& process_group();

 protected:
  FullyShardedDataParallelBase(const std::shared_ptr<torch::nn::Module>& module,
                               FSDPOptions options);
  // Gathers every unit's parameters and, with grad mode on, arms the reduction of the next
  // backward.
  void before_forward();
  // After a forward without grad mode (evaluation), or one that threw: back to the shards.
  void after_forward() noexcept;
  // A forward's argument: a tensor cast to the mixed precision's param_dtype when it asks for
  // that; anything else as it is.
  template <typename T>
  decltype(auto) cast_forward_input(T&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return cast_tensor_input(arg);
    } else {
      return std::forward<T>(arg);
    }
  }
  at::Tensor cast_tensor_input(const at::Tensor& input) const;

 private:
  std::unique_ptr<detail::FsdpCore> core_;
};

template <typename ModuleType>
class FullyShardedDataParallel : public FullyShardedDataParallelBase {
 public:
  FullyShardedDataParallel(std::shared_ptr<ModuleType> module, FSDPOptions options = {})
      : FullyShardedDataParallelBase(module, std::move(options)), module_(std::move(module)) {}
  FullyShardedDataParallel(torch::nn::ModuleHolder<ModuleType> holder, FSDPOptions options = {})
      : FullyShardedDataParallel(holder.ptr(), std::move(options)) {}

  // Forward through the wrapper: gathers the parameters, then calls the module's own forward.
  // Without grad mode (evaluation) the parameters return to their shards when it returns.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    before_forward();
    struct After {
      FullyShardedDataParallel* self;
      ~After() { self->after_forward(); }
    } after{this};
    return module_->forward(cast_forward_input(std::forward<Args>(args))...);
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  const std::shared_ptr<ModuleType>& module() const { return module_; }
  ModuleType* operator->() const { return module_.get(); }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }

 private:
  std::shared_ptr<ModuleType> module_;
};

template <typename M>
FullyShardedDataParallel(std::shared_ptr<M>, FSDPOptions = {}) -> FullyShardedDataParallel<M>;
template <typename M>
FullyShardedDataParallel(torch::nn::ModuleHolder<M>, FSDPOptions = {})
    -> FullyShardedDataParallel<M>;

}  // namespace ddp
