// Stateful: anything whose state a checkpoint saves and restores, through one interface
// (PyTorch's torch.distributed.checkpoint.stateful.Stateful: state_dict() / load_state_dict()).
//
//   // An exponential moving average of the weights: a user's own state, one class.
//   struct Ema : ddp::Stateful {
//     ddp::StateDict state_dict() override {
//       return {.tensors = {{"shadow", shadow}}, .json = fmt::format(R"({{"decay": {}}})", decay)};
//     }
//     std::string check(const ddp::StateDict& saved, const ddp::LoadContext&) override {
//       const at::Tensor* s = saved.find("shadow");
//       return s && s->sizes() == shadow.sizes() ? "" : "another shape of shadow weights";
//     }
//     void load_state_dict(const ddp::StateDict& saved, const ddp::LoadContext&) override {
//       shadow.copy_(*saved.find("shadow"));  // in place: whoever holds `shadow` sees it
//     }
//     at::Tensor shadow;
//     double decay = 0.999;
//   };
//   state.add("ema", ema);  // ddp::TrainingState (ddp/training_state.h): registered in one line
//
// A state is named tensors plus JSON (small values: counters, options, positions). What the
// library's own objects save (model, DDP's bucket order, optimizers, ZeRO, PowerSGD, sampler,
// generators) goes through this same interface: see ddp/training_state.h.
//
// The contract, for an implementation:
//   * state_dict() returns the object's state now. Tensors may alias the object's own (no copy
//     is needed): whoever keeps the result past the next change of the object clones them.
//     Called on the ranks its StateScope says, at the same point of the program on each.
//   * check(saved, context) says, without changing anything, why `saved` cannot be loaded here
//     ("" when it can). Every registered object is checked before any is loaded, so a state
//     that does not fit changes nothing.
//   * load_state_dict(saved, context) restores `saved` in place. It is only called after check()
//     accepted it; tensors in `saved` are on the CPU (copy_ moves them to the object's device).
// Thread-safety: the library calls an object from one thread at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ddp/error.h"

namespace ddp {

// Where a piece of a kSharded state lies in the whole tensor it is part of: elements
// [offset, offset + the piece's numel) of that tensor, counted in row-major order.
struct ShardPlacement {
  std::vector<int64_t> whole_shape;
  int64_t offset = 0;
};

// A range of a whole tensor's elements, in row-major order.
struct ElementRange {
  int64_t offset = 0;
  int64_t numel = 0;
};

// One object's saved state.
struct StateDict {
  // Named tensors, in order; names unique. Any dtype of fixed width, any device, contiguous or
  // not (saved as contiguous CPU copies). An undefined tensor is saved as undefined.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  // Any JSON value (text): counters, options, positions. Checked when saved (a ConfigError for
  // text that is not JSON); returned re-serialised (compact).
  std::string json = "null";
  // kSharded: which tensors are pieces of whole tensors, and where each lies (by name; every
  // name one of `tensors`). The tensors not named here are not sharded: rank 0's are saved.
  std::vector<std::pair<std::string, ShardPlacement>> shards;

  // The tensor named `name`, or null.
  const at::Tensor* find(std::string_view name) const;
  // Where the tensor named `name` lies, or null when it is not a piece.
  const ShardPlacement* shard(std::string_view name) const;
};

// Which ranks' states are saved (and which state each rank loads).
enum class StateScope {
  // The same on every rank (a DDP replica, the optimizer of a replica, the sampler's cursor):
  // rank 0's state_dict() is saved; every rank loads it.
  kReplicated,
  // Each rank's own (random generators, PowerSGD's error feedback): every rank's state_dict()
  // is saved; rank r loads rank r's, or, at another world size, rank r % saved world size's
  // (LoadContext::own says which).
  kPerRank,
  // state_dict() is a collective that every rank calls (ZeroRedundancyOptimizer consolidating
  // its shards on rank 0); rank 0's result is saved; every rank loads it.
  kCollective,
  // Each rank holds pieces of whole tensors (FullyShardedDataParallel's parameters: Note
  // [Sharded states] in src/state/shards.h): every rank's state_dict() is saved, its pieces
  // placed by StateDict::shards. When loaded, at any world size, each rank receives the elements
  // it asks for (Stateful::wanted), assembled from whichever saved pieces hold them; the tensors
  // that are not pieces, and the JSON, are rank 0's. A collective snapshot (and so a one-file
  // checkpoint) holds every piece joined into its whole tensor; a sharded checkpoint directory
  // holds each rank's pieces in the rank's own file.
  kSharded,
};

// "replicated", "per-rank", "collective", "sharded"
const char* to_string(StateScope scope);

// Where a saved state is being loaded.
struct LoadContext {
  int rank = 0;              // this process's rank
  int world_size = 1;        // this run's world size
  int saved_world_size = 1;  // the world size the state was saved at
  // kPerRank: the rank whose saved state this is (this rank's, or rank % saved_world_size);
  // `own`: it is this rank's own, at the same world size.
  int saved_rank = 0;
  bool own = true;
};

// A saved state that does not fit the object it is loaded into (another model, optimizer,
// dataset), or lacks a state that was asked for. The message names every difference found.
class IncompatibleStateError : public Error {
 public:
  using Error::Error;
};

class Stateful {
 public:
  virtual ~Stateful() = default;

  virtual StateDict state_dict() = 0;
  // Why `saved` cannot be loaded into this object ("" when it can). The default accepts
  // anything; override it so that a mismatch is reported before anything is changed.
  virtual std::string check(const StateDict& saved, const LoadContext& context);
  virtual void load_state_dict(const StateDict& saved, const LoadContext& context) = 0;
  virtual StateScope scope() const { return StateScope::kReplicated; }
  // What the object is, for messages: "optimizer" makes "it holds no optimizer state"; empty
  // (the default): the key names it.
  virtual std::string kind() const { return ""; }
  // kSharded: which elements of the saved whole tensor `name` (of `whole_shape`) this rank loads
  // now; nullopt (the default) for none. The StateDict that check() and load_state_dict() then
  // receive holds, under each saved piece's name, those elements as a 1-D tensor (placed by its
  // `shards`), or an empty one of the saved dtype where this rank loads none (its placement still
  // gives the whole shape, so that check() can compare every saved name, shape and dtype).
  virtual std::optional<ElementRange> wanted(const std::string& name,
                                             const std::vector<int64_t>& whole_shape) const;
};

}  // namespace ddp
