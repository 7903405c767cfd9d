// ddp-cpp: data-parallel training for C++ on LibTorch. The umbrella header of the distributed
// API. Beside it: ddp/runtime.h (the BLAS, threads, memory, the launch environment) and
// ddp/datasets.h (Fashion-MNIST).
#pragma once

#include "ddp/checkpoint.h"                 // Checkpointer, save/load_checkpoint: exact resume
#include "ddp/comm_hooks.h"                 // GradBucket, Future, comm_hooks::fp16_compress, ...
#include "ddp/config.h"                     // DDP_VERSION, DDP_WITH_NCCL
#include "ddp/data_loader.h"                // DataLoader, LoaderOptions: batches, worker threads
#include "ddp/dataset.h"                    // Dataset, TensorDataset, Batch
#include "ddp/distributed.h"                // init_process_group, get_rank, all_reduce, ...
#include "ddp/distributed_data_parallel.h"  // DistributedDataParallel, DDPOptions
#include "ddp/error.h"                      // ddp::Error and its subclasses
#include "ddp/fault_tolerance.h"            // ft::Manager: a failure costs a step, not a restart
#include "ddp/fully_sharded_data_parallel.h"  // FullyShardedDataParallel, FSDPOptions: ZeRO-2
#include "ddp/join.h"                       // Join: uneven inputs across ranks
#include "ddp/metrics.h"                    // EvalStats, all_reduce(EvalStats): exact evaluation
#include "ddp/process_group.h"              // ProcessGroup, Work, ReduceOp, InitOptions
#include "ddp/relayed_error.h"              // Relayed<E>, record_error(exception): who failed first
#include "ddp/run_lease.h"                  // RunLease: one group writes into a run folder
#include "ddp/sampler.h"                    // DistributedSampler, SamplerOptions, SamplerState
#include "ddp/stateful.h"                   // Stateful, StateDict: your own saved state
#include "ddp/sync_batch_norm.h"            // SyncBatchNorm, convert_sync_batchnorm
#include "ddp/training_state.h"             // TrainingState: what a checkpoint saves, Snapshot
#include "ddp/zero_redundancy_optimizer.h"  // ZeroRedundancyOptimizer: sharded optimizer state
