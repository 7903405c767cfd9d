// Exact distributed evaluation: every sample counted once, the same numbers as one process.
//
//   ddp::DistributedSampler eval_sampler(test->size(),
//       {.num_replicas = pg.size(), .rank = pg.rank(), .shuffle = false, .pad = false});
//   ddp::DataLoader eval_loader(test, eval_sampler, {.batch_size = 256});
//   ddp::EvalStats local;
//   torch::NoGradGuard no_grad;
//   for (auto& b : eval_loader) {
//     at::Tensor logp = torch::log_softmax(model(b.data), 1);                      // [B, C]
//     at::Tensor loss = torch::nll_loss(logp, b.target, {}, at::Reduction::None);  // [B]
//     local.add(logp, b.target, loss);
//   }
//   ddp::EvalStats all = ddp::all_reduce(local, pg);   // every rank gets the totals
//   all.accuracy(); all.mean_loss();
//
// Why it is exact. A training sampler pads the list to a multiple of the world size, so a few
// samples are evaluated twice and the accuracy depends on the world size. With pad=false
// (see ddp/sampler.h) rank r evaluates r, r+R, r+2R, ...: each sample once. Each rank keeps
// sums, not means: the loss sum in double, the correct and sample counts in int64, and the
// all-reduce adds them. Counts are exact. The loss sum is exact too in practice: each per-sample
// loss is a float (24 significant bits) added into a double (53 bits), so no addition rounds
// while sum / smallest_loss < ~2^29 (e.g. 10000 samples of mean loss 0.5 whose smallest loss
// is above 1e-5); then the sum does not depend on the order of addition, hence not on the
// world size (tested at 1, 2, 3). Beyond that it may differ in the last bit (1e-16 relative).
//
// Thread-safety: EvalStats is a plain value. all_reduce is a collective: every rank of the
// group calls it, in the same order relative to its other collectives.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "ddp/process_group.h"

namespace ddp {

struct EvalStats {
  double loss_sum = 0.0;  // sum over samples of the per-sample loss
  int64_t correct = 0;    // samples whose argmax prediction equals the target
  int64_t count = 0;      // samples seen

  // Adds one batch: output [B, C] (logits or log-probabilities; argmax over dim 1), target [B]
  // (class indices), per_sample_loss [B] (reduction "none"). An undefined per_sample_loss adds
  // to correct and count only. Throws ddp::ConfigError when the batch sizes disagree.
  void add(const at::Tensor& output, const at::Tensor& target,
           const at::Tensor& per_sample_loss = {});
  // Merges another partial result (e.g. another thread's).
  EvalStats& operator+=(const EvalStats& other);

  double accuracy() const;   // correct / count; 0 when count is 0
  double mean_loss() const;  // loss_sum / count; 0 when count is 0
};

// Sums the three fields over the ranks of `pg` (two all-reduces: double and int64); blocking.
EvalStats all_reduce(const EvalStats& local, ProcessGroup& pg);
// Over the default process group; before init_process_group() it returns `local` unchanged.
EvalStats all_reduce(const EvalStats& local);

}  // namespace ddp
