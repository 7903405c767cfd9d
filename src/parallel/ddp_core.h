// The machinery behind DistributedDataParallel<M>, minus the module type: construction
// (parameter check, rank 0's state copied, the reducer), forward preparation, no_sync, and the
// steps ddp::Join drives (include/ddp/join.h). Internal: the public face is
// DistributedDataParallelBase in include/ddp/distributed_data_parallel.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ddp/distributed_data_parallel.h"

namespace ddp {

struct JoinOptions;

namespace detail {

class DdpCore {
 public:
  DdpCore(std::shared_ptr<torch::nn::Module> module, DDPOptions options);
  ~DdpCore();

  // Each forward through the wrapper: join round (when a Join is attached), bucket rebuild
  // when due, buffer broadcast.
  void before_forward();
  void register_comm_hook(CommHook hook);
  bool require_sync() const { return require_sync_; }
  void set_require_sync(bool on) { require_sync_ = on; }
  ProcessGroup& process_group();
  torch::nn::Module& module() const;
  const IterationStats& last_iteration_stats() const;
  std::vector<std::vector<std::string>> bucket_layout() const;  // names per bucket
  std::vector<int64_t> bucket_order() const;
  void restore_bucket_order(const std::vector<int64_t>& order);
  // Fault tolerance (Note [Per-step fault tolerance]): reduce and broadcast buffers over
  // `group` from now on (Reducer::rebind). Between iterations, on every rank of `group`.
  void rebind(std::shared_ptr<ProcessGroup> group);

  // What ddp::Join drives. attach_join/detach (null); one round of "who is still training"
  // (an all-gather; returns the active ranks, ascending); shadow one iteration of the others;
  // copy `root`'s parameters and buffers; the last rank seen training.
  void attach_join(const JoinOptions* options);
  std::vector<int> join_round(bool active);
  void shadow_iteration(const std::vector<int>& active);
  void sync_model_from(int root);
  int last_active_rank() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  bool require_sync_ = true;
};

}  // namespace detail
}  // namespace ddp
