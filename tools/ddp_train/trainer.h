// ddp-train's training run: data, model, DDP, optimizer, schedule, evaluation, checkpoints.
//
// Note [Training loop]
// Per epoch: sampler.set_epoch(e) (a restored sampler keeps its position in that epoch), then
// per optimizer step, grad_accum micro-batches: all but the last under model.no_sync(), each
// loss divided by the number of micro-batches in the step, so the step applies the mean over
// all ranks' and micro-batches' samples. The rate follows warmup + cosine as a function of
// the step (nothing to save). Every log_every steps the interval's mean training loss is
// all-reduced (every rank knows the step, so every rank joins) and rank 0 logs it. At the end
// of each epoch the test set is evaluated exactly (each sample once, ddp/metrics.h) on
// model.module() — the wrapper is not used for evaluation, so no collective is involved —
// and a checkpoint is written with the sampler already at the next epoch's start. Checkpoints
// also every checkpoint_every steps, always at an optimizer-step boundary, and they carry
// DDP's rebuilt bucket order, so a resumed run continues bit for bit (same world size, CPU,
// fp32): same data, RNG, optimizer state and the same summation order of every all-reduce.
#pragma once

#include "config.h"

namespace ddp::train {

// Runs training as configured. Collective: every rank calls it. Throws ddp::Error subclasses.
// Returns the process exit code.
int run(const TrainConfig& config);

}  // namespace ddp::train
