// TrainingState: the objects whose state a run saves, each under a key, saved and restored
// through one door (ddp/stateful.h): into a checkpoint file (ddp/checkpoint.h), or into a
// Snapshot in memory (what a live rank hands another).
//
//   ddp::TrainingState state;
//   state.add("model", model);              // a DistributedDataParallel: the module's parameters
//                                           // and buffers, and DDP's bucket order
//   state.add("optimizer", opt);            // any torch::optim optimizer, or a ZeRO one
//   state.add("sampler", sampler);          // the epoch and the position in it
//   state.add("rng", ddp::default_generators());  // every rank's random generators
//   state.add("ema", ema);                  // your own ddp::Stateful
//   ckpt.save(state, {.step = step, .epoch = epoch}, *pg);       // ddp::Checkpointer
//   ckpt.load(path, state, *pg);            // every object restored in place, or none
//
// What the library's own objects save (their adapters):
//   torch::nn::Module                 parameters then buffers by name (recursive, registration
//                                     order); loading copies in place (optimizers and DDP's
//                                     bucket views keep seeing the same storage) and refuses
//                                     another model naming each differing tensor
//   DistributedDataParallel           its module as above, plus the bucket order DDP rebuilt
//                                     after its first iteration (bucket_order()), restored so
//                                     that a resumed run sums in the same buckets, hence to the
//                                     same bits, from its first step. Register the wrapper, not
//                                     model.module(): the module alone loses the order.
//   torch::optim::Optimizer           per-parameter state and each param group's options (lr,
//                                     momentum, ... as a scheduler left them); refuses another
//                                     optimizer type or split into param groups
//   ZeroRedundancyOptimizer           kCollective: consolidated on rank 0 when saved, each rank
//                                     takes its part when loaded, at any world size (Note [ZeRO
//                                     checkpoints] in ddp/zero_redundancy_optimizer.h)
//   FullyShardedDataParallel          kSharded: each rank's part of every parameter
//                                     (local_shards(), clean names), each rank taking its new
//                                     part when loaded, at any world size; bit for bit at the
//                                     saving one. Joined whole in a one-file checkpoint
//   an optimizer over its shards      add(key, opt, model): kSharded, its state cut at the
//                                     parameters' bounds ("exp_avg/fc1.weight"), loaded at any
//                                     world size (Adam, AdamW, SGD, Adagrad, RMSprop; another
//                                     type kPerRank: the saving world size only)
//   comm_hooks::PowerSGDState         kPerRank: iteration, generator, P, Q and this rank's
//                                     error feedback; at another world size without the error
//                                     feedback (P, Q, iteration and generator are every rank's)
//   DistributedSampler                the cursor (SamplerState): resumes mid-epoch, also at
//                                     another world size (Note [Sampler position and resume])
//   default_generators()              kPerRank: LibTorch's default CPU generator and each CUDA
//                                     device's; at another world size rank r takes rank
//                                     r % saved world size's
//
// Exact resume: restoring everything a run's numbers depend on (the model, DDP's bucket order,
// the optimizer, the sampler, the generators, hook states) at the same world size makes it
// continue bit for bit. Not captured: the number of intra-op threads, the BLAS, anything with
// its own RNG: register a Stateful for the latter.
//
// Lifetime: add() keeps a reference to the object (or shares ownership of a shared_ptr): the
// object must outlive the TrainingState. Every rank registers the same keys, in the same order,
// with the same scopes (a collective save checks it and names the first difference).
// Thread-safety: none; one thread builds and uses a TrainingState.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/stateful.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace ddp {

class DistributedDataParallelBase;
class DistributedSampler;
class FullyShardedDataParallelBase;
class ProcessGroup;
class ZeroRedundancyOptimizer;
namespace comm_hooks {
class PowerSGDState;
}

// A TrainingState captured in memory: every key's state, as saved. Tensors may alias the live
// objects' (the model's parameters): encode it (ddp/checkpoint.h) or clone before training on.
struct Snapshot {
  struct Entry {
    std::string key;
    StateScope scope = StateScope::kReplicated;
    // One state; kPerRank: one per rank, indexed by rank (what a collective snapshot gathered).
    std::vector<StateDict> ranks;
  };
  std::vector<Entry> entries;  // in registration order
  int world_size = 1;          // of the run that took it

  const Entry* find(std::string_view key) const;
};

// What restore() did besides restoring.
struct RestoreReport {
  bool world_size_changed = false;  // the snapshot was taken at another world size
  // Every kPerRank state loaded was this rank's own (same world size; none missing).
  bool per_rank_exact = true;
  std::vector<std::string> absent;   // optional keys the snapshot lacks: left as they were
  std::vector<std::string> ignored;  // keys in the snapshot that this state does not have
};

struct AddOptions {
  // A snapshot or checkpoint without this key restores anyway, leaving the object as it is
  // (RestoreReport::absent names it): for state added to a program whose older checkpoints
  // lack it. Default: required (its absence is an IncompatibleStateError).
  bool optional = false;
};

class TrainingState {
 public:
  TrainingState();
  ~TrainingState();
  TrainingState(TrainingState&&) noexcept;
  TrainingState& operator=(TrainingState&&) noexcept;

  // Registers `object` under `key`: non-empty, at most 200 characters of letters, digits and
  // "_-./", unique in this state (ConfigError otherwise). The overloads below wrap the
  // library's objects in their adapters (see the top).
  void add(std::string key, std::shared_ptr<Stateful> object, AddOptions options = {});
  void add(std::string key, Stateful& object, AddOptions options = {});  // not owned
  void add(std::string key, torch::nn::Module& module, AddOptions options = {});
  void add(std::string key, DistributedDataParallelBase& model, AddOptions options = {});
  void add(std::string key, torch::optim::Optimizer& optimizer, AddOptions options = {});
  void add(std::string key, ZeroRedundancyOptimizer& optimizer, AddOptions options = {});
  void add(std::string key, FullyShardedDataParallelBase& model, AddOptions options = {});
  // The optimizer over a FullyShardedDataParallel's shards (model.parameters()).
  void add(std::string key, torch::optim::Optimizer& optimizer,
           FullyShardedDataParallelBase& sharded_by, AddOptions options = {});
  void add(std::string key, DistributedSampler& sampler, AddOptions options = {});
  void add(std::string key, comm_hooks::PowerSGDState& state, AddOptions options = {});
  // A module held by pointer or holder (std::shared_ptr<Net>, Net): its module.
  template <typename M>
  requires requires(M& m) { static_cast<torch::nn::Module&>(*m); }
  void add(std::string key, M& holder, AddOptions options = {}) {
    add(std::move(key), static_cast<torch::nn::Module&>(*holder), options);
  }

  std::vector<std::string> keys() const;
  bool contains(std::string_view key) const;
  // Calls `f` with every registered object (adapters for the library's), in registration order.
  void for_each(const std::function<void(const std::string& key, Stateful& object)>& f) const;

  // This process's state: every object's state_dict() here, kPerRank ones as this rank's
  // alone (Snapshot::Entry::ranks holds one state). No collective besides those a kCollective
  // object makes inside its state_dict(): call it on every rank when there is one.
  Snapshot snapshot();
  // A collective over `group` (every rank calls it at the same point): the whole state on rank
  // 0, kPerRank entries with every rank's state (gathered), the others as rank 0 saw them;
  // the other ranks get an empty Snapshot. Throws ConfigError on every rank when the ranks
  // registered different keys or scopes, naming the first difference.
  Snapshot snapshot(ProcessGroup& group);

  // Checks every registered object against `snapshot` (missing keys, each object's check()),
  // then restores every one in place; an IncompatibleStateError naming every difference
  // (and nothing restored) when any does not fit. `rank` and `world_size`: this run's (which
  // kPerRank state each rank takes).
  RestoreReport restore(const Snapshot& snapshot, int rank = 0, int world_size = 1);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A Stateful from two functions, for small state kept as JSON text (a scheduler, counters):
//   state.add("scheduler", ddp::json_state([&] { return sched.to_json(); },
//                                          [&](const std::string& j) { sched.from_json(j); }));
// kReplicated, no check of its own: `load` receives the JSON that `save` returned
// (re-serialised) once every other state was checked, and should not throw for it.
std::shared_ptr<Stateful> json_state(std::function<std::string()> save,
                                     std::function<void(const std::string&)> load);

// LibTorch's default generators of this process (CPU, and each CUDA device's), kPerRank. Every
// call returns an object for the same process-wide generators.
std::shared_ptr<Stateful> default_generators();

}  // namespace ddp
