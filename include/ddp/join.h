// Join: training on uneven inputs, when ranks have different numbers of batches.
//
//   ddp::Join join(model);                    // on every rank, before the loop
//   for (auto& batch : my_batches) {          // some ranks have fewer batches than others
//     opt.zero_grad();
//     loss_fn(model(batch.data), batch.target).backward();
//     opt.step();
//   }
//   join.finish();                            // every rank, after its last batch
//
// Without it, a rank that runs out of data stops calling the collectives the others' backward
// needs, and they wait until their timeout. With it, as PyTorch's torch.distributed.algorithms
// .Join: at each forward, every rank still training says so in a small all-gather; a rank in
// finish() answers "done" to the same all-gather and then shadows that iteration's collectives
// (bucket rebuild if due, buffer broadcast, every gradient bucket through the comm hook, the
// unused-parameter bitmap) with zeros, until a round shows no rank still training. Then every
// rank copies the parameters and buffers of the last rank that trained, so all replicas end
// identical. Gradients of each iteration are averaged over the ranks still training
// (divide_by_initial_world_size = false, the default here); PyTorch's default divides by the
// whole world size instead, which scales the update down as ranks join.
//
// Under a Join, every forward through the wrapper must be a training step with one synced
// backward (no no_sync(), no evaluation forwards through the wrapper: evaluate model.module()).
// Buffers are broadcast from the highest rank still training. Joined ranks do not step their
// optimizer; their optimizer state (e.g. momentum) is theirs, only the model is synchronised.
#pragma once

#include "ddp/distributed_data_parallel.h"

namespace ddp {

struct JoinOptions {
  // false: divide by the ranks still training (ddp-cpp's default: each update is the mean over
  // the ranks that contributed); true: PyTorch's default, divide by the whole world size.
  bool divide_by_initial_world_size = false;
  // Every rank throws ddp::Error as soon as any rank runs out of data (to stop all together).
  bool throw_on_early_termination = false;
};

class Join {
 public:
  // Attaches to `model` (any DistributedDataParallel<M>) until destroyed.
  explicit Join(DistributedDataParallelBase& model, JoinOptions options = {});
  // Detaches. If finish() was not called (and no exception is in flight) it warns: the other
  // ranks would wait for this one until their collective timeout.
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // Call once this rank has no more batches: takes part in the other ranks' iterations until
  // all are done, then synchronises the final model. Collective. Throws ddp::Error on a failed
  // collective, or (throw_on_early_termination) when another rank is still training.
  void finish();

 private:
  detail::DdpCore& core_;
  JoinOptions options_holder_;  // the core points here while attached
  bool finished_ = false;
};

}  // namespace ddp
