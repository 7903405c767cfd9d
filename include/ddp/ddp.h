// ddp-cpp: data-parallel training for C++ on LibTorch. The umbrella header.
#pragma once

#include "ddp/allocator.h"                  // retain_freed_memory
#include "ddp/blas.h"                       // ensure_fast_blas, inspect_blas
#include "ddp/checkpoint.h"                 // Checkpointer, save/load_checkpoint: exact resume
#include "ddp/comm_hooks.h"                 // GradBucket, Future, comm_hooks::fp16_compress, ...
#include "ddp/config.h"                     // DDP_VERSION, DDP_WITH_NCCL
#include "ddp/data_loader.h"                // DataLoader, LoaderOptions: batches, worker threads
#include "ddp/datasets.h"                   // Dataset, TensorDataset, FashionMnist, read_idx_*
#include "ddp/distributed_data_parallel.h"  // DistributedDataParallel, DDPOptions
#include "ddp/join.h"                       // Join: uneven inputs across ranks
#include "ddp/distributed.h"                // init_process_group, get_rank, all_reduce, ...
#include "ddp/env.h"                        // the launch environment contract
#include "ddp/error.h"                      // ddp::Error and its subclasses
#include "ddp/metrics.h"                    // EvalStats, all_reduce(EvalStats): exact evaluation
#include "ddp/process_group.h"              // ProcessGroup, Work, ReduceOp, InitOptions
#include "ddp/relayed_error.h"              // Relayed<E>, record_error(exception): who failed first
#include "ddp/sampler.h"                    // DistributedSampler, SamplerOptions, SamplerState
#include "ddp/stateful.h"                   // Stateful, StateDict: your own saved state
#include "ddp/sync_batch_norm.h"            // SyncBatchNorm, convert_sync_batchnorm
#include "ddp/threads.h"                    // set_num_threads: LibTorch's and the BLAS's
#include "ddp/training_state.h"             // TrainingState: what a checkpoint saves, Snapshot
#include "ddp/zero_redundancy_optimizer.h"  // ZeroRedundancyOptimizer: sharded optimizer state
