// ddp-bench train: training throughput of one model at this world size, and where each step's
// time goes.
//
//   ddp-bench train --model classic-cnn --threads 2                  # world 1: the baselines
//   ddprun --standalone --nproc-per-node 2 ddp-bench train --model mlp-1024 --compare
//
// Fashion-MNIST, SGD with momentum, a fixed global batch split over the ranks (batch / world per
// rank, whole batches only), DistributedDataParallel over the group (a pass-through at world
// size 1). Warm-up steps, then timed steps; samples/s = steps x global batch / the slowest
// rank's wall time. The breakdown, in ms per step, averaged over the timed steps and the ranks:
//   data       taking the next batch from the loader
//   forward    model forward and the loss
//   backward   backward's compute: backward()'s wall time less the exposed communication
//   comm       exposed communication: from backward's end-of-graph callback to every bucket
//              reduced and written back (DDP's IterationStats finalize_start_s..finalize_end_s);
//              the all-reduces hidden behind backward's compute cost nothing here
//   optimizer  opt.step() and zero_grad()
// Scaling efficiency = throughput at N ranks / (N x throughput of 1 process x 1 thread); the
// alternative on one host is 1 process x N intra-op threads. --compare measures both on rank 0
// in the same run, after the N-rank measurement, while the other ranks wait in a barrier;
// --repeats R alternates the three R times and reports medians. benchmarks/scaling.sh does the
// same with separate processes.
// --device cuda (or auto with a GPU: cuda:LOCAL_RANK) trains on the GPU, batches pinned and
// copied by the loader, each phase ended by a device synchronize; --compare stays CPU-only.
#pragma once

#include "options.h"

namespace ddp::bench {

// Collective: every rank calls it. Returns the exit code.
int run_train(const TrainOptions& options);

}  // namespace ddp::bench
