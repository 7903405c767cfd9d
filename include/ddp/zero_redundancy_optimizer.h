// ddp::ZeroRedundancyOptimizer: optimizer state sharded across ranks (ZeRO stage 1), after
// PyTorch's torch.distributed.optim.ZeroRedundancyOptimizer.
//
//   auto zero = ddp::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
//       model->parameters(), torch::optim::AdamWOptions(1e-3));
//   loss.backward();   // DDP averaged the gradients: every rank holds all of them
//   zero.step();       // this rank steps its shard; every rank then holds every new parameter
//
// Note [ZeRO-1]
// Each parameter is owned by one rank, chosen as PyTorch chooses (largest parameter first, to
// the rank holding the fewest elements so far), so every rank owns about 1/world of the
// elements. A rank's optimizer is built over its own parameters only: the optimizer state
// (Adam's two moments, SGD's momentum) exists once in the job instead of once per rank. step()
// runs that optimizer, then each rank broadcasts its updated parameters, flattened into one
// buffer per dtype, to the others (world broadcasts a step, like PyTorch's
// parameters_as_bucket_view). Gradients must be the same on every rank (DDP's all-reduce); the
// parameters then stay identical everywhere, and each update is the one an unsharded optimizer
// makes, element for element (the optimizers update each parameter on its own). Every rank must
// call step() together: it is a collective.
//
// Note [ZeRO overlapped with DDP]
// ZeroOptions::overlap_with_ddp, as PyTorch's: the shard's step runs inside DDP's comm hook,
// bucket by bucket, instead of in step() after backward. With `zero` a shared_ptr to it:
//   model.register_comm_hook(comm_hooks::hook_with_zero_step(comm_hooks::allreduce(), zero));
// then step() does nothing (nor does PyTorch's) and zero_grad() works as usual. Each DDP bucket
// is owned by one rank, given out as the buckets come (to the rank owning the fewest elements
// so far, PyTorch's rule); when a bucket's all-reduce is done, its owner steps its parameters
// with the averaged gradients (an optimizer per owned bucket) and broadcasts them; nobody waits
// for a broadcast before the next bucket (owners step at once), the last bucket waits for them
// all, so every rank holds every updated parameter when backward returns. As in PyTorch
// (static_graph false), the first two iterations update nothing: DDP rebuilds its buckets after
// the first. The steps run when DDP waits for each bucket (Note [Chained futures]): in bucket
// order after backward's compute, overlapping the later buckets' all-reduces, not backward.
// Checkpoints work as without the option (Note [ZeRO checkpoints]); the state also holds the
// hook's iteration count, so a resumed run does not skip two updates again, and a state loaded
// before a bucket is given out waits for it (each rank keeps the states of the parameters it
// comes to own). Restore DDP's bucket order too (bucket_order(), restore_bucket_order()): the
// owners follow the buckets, and a bucket that changes after its owner was chosen is a
// ConfigError.
//
// Note [ZeRO checkpoints]
// shard_state() is this rank's part: for each parameter it owns, the global index, its element
// count and its optimizer state; the optimizer's options beside. consolidate_state_dict(to)
// gathers every rank's part on rank `to` (a collective), whose state_dict() then returns all of
// them as one blob, the consolidated state; the next step() drops that copy. load_state_dict() takes a consolidated state saved
// at any world size (the parameters are partitioned again, each rank reading the states of the
// parameters it now owns), or this rank's own shard at the same world size. A parameter the
// state does not cover, or whose element count differs, is an error naming it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "ddp/comm_hooks.h"  // hook_with_zero_step
#include "ddp/error.h"       // what its calls throw
#include "ddp/process_group.h"

namespace ddp {

class ZeroRedundancyOptimizer;

struct ZeroOptions {
  bool overlap_with_ddp = false;  // Note [ZeRO overlapped with DDP]
};

namespace comm_hooks {
// `hook` (e.g. allreduce()) followed, for each bucket, by its owner's optimizer step and the
// broadcast of its updated parameters (Note [ZeRO overlapped with DDP]). `zero` must be made
// with ZeroOptions::overlap_with_ddp over the DDP model's parameters, on its process group.
CommHook hook_with_zero_step(CommHook hook, std::shared_ptr<ZeroRedundancyOptimizer> zero);
}  // namespace comm_hooks

// What ZeroRedundancyOptimizer needs to know of an optimizer type: its per-parameter state
// (a fresh one, to load into) and that state's tensors (to count its bytes). Defined below for
// LibTorch's SGD, Adam, AdamW, Adagrad and RMSprop.
template <class Optimizer>
struct ZeroOptimizerTraits;

class ZeroRedundancyOptimizer {
 public:
  using OptimizerFactory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> shard)>;
  using StateFactory = std::function<std::unique_ptr<torch::optim::OptimizerParamState>()>;
  using StateTensors =
      std::function<std::vector<at::Tensor>(const torch::optim::OptimizerParamState&)>;

  // This rank's Optimizer(shard, options) over the parameters it owns in `group` (default: the
  // default group).
  template <class Optimizer, class Options>
  static ZeroRedundancyOptimizer make(std::vector<at::Tensor> params, const Options& options,
                                      std::shared_ptr<ProcessGroup> group = nullptr,
                                      ZeroOptions zero_options = {}) {
    using Traits = ZeroOptimizerTraits<Optimizer>;
    return ZeroRedundancyOptimizer(
        std::move(params),
        [options](std::vector<at::Tensor> shard) -> std::unique_ptr<torch::optim::Optimizer> {
          return std::make_unique<Optimizer>(std::move(shard), options);
        },
        [] { return std::make_unique<typename Traits::State>(); }, &Traits::tensors,
        std::move(group), &typeid(Optimizer), zero_options);
  }

  // Any optimizer: `make_optimizer` builds it over a shard, `make_state` makes an empty
  // per-parameter state of its kind (for load_state_dict), `state_tensors` lists a state's
  // tensors (for state_bytes; may be empty); `type` names the optimizer's class (for
  // checkpoints; else taken from this rank's optimizer).
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, OptimizerFactory make_optimizer,
                          StateFactory make_state, StateTensors state_tensors = nullptr,
                          std::shared_ptr<ProcessGroup> group = nullptr,
                          const std::type_info* type = nullptr, ZeroOptions zero_options = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(ZeroRedundancyOptimizer&&) noexcept;
  ZeroRedundancyOptimizer& operator=(ZeroRedundancyOptimizer&&) noexcept;

  // A collective: this rank's optimizer steps its shard, then every rank receives every
  // updated parameter. With overlap_with_ddp: nothing (the hook stepped), once the hook is
  // registered (before that, ConfigError).
  void step();
  void zero_grad(bool set_to_none = true);

  // The learning rate of every parameter group of this rank's optimizer (schedulers).
  void set_lr(double lr);
  double lr() const;

  // The rank whose optimizer steps params[index] (with overlap_with_ddp: -1 until its bucket
  // was given out); the indices this rank owns.
  int owner(size_t index) const;
  const std::vector<size_t>& owned() const;
  // This rank's optimizer (null when it owns no parameter: more ranks than parameters; and
  // with overlap_with_ddp, where each owned bucket has its own).
  torch::optim::Optimizer* optimizer();
  // Bytes of this rank's optimizer state tensors.
  int64_t state_bytes() const;
  // "ddp::ZeroRedundancyOptimizer(torch::optim::AdamW)": what a checkpoint records.
  const std::string& type_name() const;
  int rank() const;  // this process's rank in the optimizer's group

  // Note [ZeRO checkpoints].
  std::string shard_state() const;
  void consolidate_state_dict(int to = 0);  // a collective
  std::string state_dict() const;  // on rank `to` after consolidate_state_dict, until step()
  void load_state_dict(const std::string& state);

 private:
  friend CommHook comm_hooks::hook_with_zero_step(CommHook,
                                                  std::shared_ptr<ZeroRedundancyOptimizer>);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

template <>
struct ZeroOptimizerTraits<torch::optim::SGD> {
  using State = torch::optim::SGDParamState;
  static std::vector<at::Tensor> tensors(const torch::optim::OptimizerParamState& s) {
    return {static_cast<const State&>(s).momentum_buffer()};
  }
};
template <>
struct ZeroOptimizerTraits<torch::optim::Adam> {
  using State = torch::optim::AdamParamState;
  static std::vector<at::Tensor> tensors(const torch::optim::OptimizerParamState& s) {
    const auto& a = static_cast<const State&>(s);
    return {a.exp_avg(), a.exp_avg_sq(), a.max_exp_avg_sq()};
  }
};
template <>
struct ZeroOptimizerTraits<torch::optim::AdamW> {
  using State = torch::optim::AdamWParamState;
  static std::vector<at::Tensor> tensors(const torch::optim::OptimizerParamState& s) {
    const auto& a = static_cast<const State&>(s);
    return {a.exp_avg(), a.exp_avg_sq(), a.max_exp_avg_sq()};
  }
};
template <>
struct ZeroOptimizerTraits<torch::optim::Adagrad> {
  using State = torch::optim::AdagradParamState;
  static std::vector<at::Tensor> tensors(const torch::optim::OptimizerParamState& s) {
    return {static_cast<const State&>(s).sum()};
  }
};
template <>
struct ZeroOptimizerTraits<torch::optim::RMSprop> {
  using State = torch::optim::RMSpropParamState;
  static std::vector<at::Tensor> tensors(const torch::optim::OptimizerParamState& s) {
    const auto& r = static_cast<const State&>(s);
    return {r.square_avg(), r.momentum_buffer(), r.grad_avg()};
  }
};

}  // namespace ddp
