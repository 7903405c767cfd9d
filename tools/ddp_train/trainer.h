// ddp-train's training run: data, model, DDP, optimizer, schedule, evaluation, checkpoints.
//
// Note [Training loop]
// Per epoch: sampler.set_epoch(e) (a restored sampler keeps its position in that epoch), then
// per optimizer step, grad_accum micro-batches: all but the last under model.no_sync(), each
// loss divided by the number of micro-batches in the step, so the step applies the mean over
// all ranks' and micro-batches' samples. The rate follows warmup + cosine as a function of
// the run's position (nothing to save; Note [Progress]). Every log_every steps the interval's mean training loss is
// all-reduced (every rank knows the step, so every rank joins) and rank 0 logs it. At the end
// of each epoch the test set is evaluated exactly (each sample once, ddp/metrics.h) on
// model.module() — the wrapper is not used for evaluation, so no collective is involved —
// and a checkpoint is written with the sampler already at the next epoch's start. Checkpoints
// also every checkpoint_every steps, always at an optimizer-step boundary, and they carry
// DDP's rebuilt bucket order, so a resumed run continues bit for bit (same world size, CPU,
// fp32): same data, RNG, optimizer state and the same summation order of every all-reduce.
// After each step the ranks agree whether to stop for a SIGTERM (Note [Preemption],
// preemption.h).
//
// Note [Progress]
// A run's position is measured in samples: the epoch, and how much of that epoch's shuffled
// list the ranks have consumed together (the sampler's cursor, saved in every checkpoint). At
// world size W an epoch is S(W) optimizer steps, so the learning rate of a step is the
// schedule (warmup_epochs * S(W) steps of linear warmup, then cosine to 0 at epochs * S(W))
// at schedule step epoch * S(W) + (steps of the epoch already done). Uninterrupted, or resumed
// at the same world size, that is the step count itself. Resumed at another world size W', the
// sampler splits the rest of the epoch among the new ranks; the steps left of the epoch are
// counted at W' and the schedule is the W' one, so the rate continues from (within one step
// of) the same point of the curve, the last step of the last epoch ends the curve as an
// uninterrupted W' run does, and the run trains exactly the epochs asked for. The step counter
// (metrics.csv, checkpoint names, --log-every, --checkpoint-every, --max-steps) counts
// optimizer steps taken, by every attempt together, so it never goes back; after a resume at
// another world size it differs from the schedule step. A resumed run first drops the
// metrics.csv rows past its checkpoint's step (those of the interrupted attempt).
#pragma once

#include "config.h"

namespace ddp::train {

// Runs training as configured. Collective: every rank calls it. Throws ddp::Error subclasses.
// Returns the process exit code.
int run(const TrainConfig& config);

}  // namespace ddp::train
