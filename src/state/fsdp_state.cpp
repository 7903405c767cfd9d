// FullyShardedDataParallel's saved state (see include/ddp/training_state.h): the model's
// parameters whole (kCollective), and the optimizer over its shards (kPerRank).
#include <fmt/format.h>

#include "ddp/fully_sharded_data_parallel.h"
#include "state/adapters.h"

namespace ddp::state {
namespace {

// The parameters whole: gathered on every rank when saved (rank 0's saved), each rank's shards
// taken from them when loaded, at any world size. The shards are slices of the whole parameters
// (their padding zero), so a load at the saving world size restores them bit for bit.
class FsdpModelState : public Stateful {
 public:
  explicit FsdpModelState(FullyShardedDataParallelBase& model) : model_(model) {}
  StateDict state_dict() override { return {.tensors = model_.full_parameters()}; }
  std::string check(const StateDict& saved, const LoadContext&) override {
    return model_.check_full_parameters(saved.tensors);
  }
  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    model_.load_full_parameters(saved.tensors);
  }
  StateScope scope() const override { return StateScope::kCollective; }
  std::string kind() const override { return "FullyShardedDataParallel model"; }

 private:
  FullyShardedDataParallelBase& model_;
};

// An optimizer over a FullyShardedDataParallel's shards: each rank's own state (the shards'
// momentum, Adam's moments, ...), loaded only where it was saved: the same world size, the
// same rank. Another world size shards differently; the message says what to do.
class FsdpOptimizerState : public Stateful {
 public:
  explicit FsdpOptimizerState(torch::optim::Optimizer& optimizer)
      : inner_(optimizer_state(optimizer)) {}
  StateDict state_dict() override { return inner_->state_dict(); }
  std::string check(const StateDict& saved, const LoadContext& context) override {
    if (!context.own) {
      return fmt::format(
          "the optimizer state of a FullyShardedDataParallel is each rank's own and was saved "
          "at world size {}, not {}: resume at {} ranks, or restore the model alone (add the "
          "optimizer with AddOptions{{.optional = true}} under another key)",
          context.saved_world_size, context.world_size, context.saved_world_size);
    }
    return inner_->check(saved, context);
  }
  void load_state_dict(const StateDict& saved, const LoadContext& context) override {
    inner_->load_state_dict(saved, context);
  }
  StateScope scope() const override { return StateScope::kPerRank; }
  std::string kind() const override { return "optimizer"; }

 private:
  std::shared_ptr<Stateful> inner_;
};

}  // namespace

std::shared_ptr<Stateful> fsdp_state(FullyShardedDataParallelBase& model) {
  return std::make_shared<FsdpModelState>(model);
}

std::shared_ptr<Stateful> fsdp_optimizer_state(torch::optim::Optimizer& optimizer) {
  return std::make_shared<FsdpOptimizerState>(optimizer);
}

}  // namespace ddp::state
