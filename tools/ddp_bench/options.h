// ddp-bench's two modes and every flag of each, with its default.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::bench {

inline constexpr int64_t kDefaultMinBytes = 8;                   // nccl-tests' -b 8
inline constexpr int64_t kDefaultMaxBytes = int64_t{256} << 20;  // nccl-tests' usual top: 256 MiB
inline constexpr int kDefaultIters = 20;                         // nccl-tests' -n 20
inline constexpr int kDefaultWarmup = 5;                         // nccl-tests' -w 5
// Bytes of buffers cycled through, per size: more than a last-level cache holds, so that no
// iteration finds its data cache-warm from the one before (Note [Buffer ring]).
inline constexpr int64_t kDefaultRingBytes = int64_t{64} << 20;

// ddp-bench collectives: an nccl-tests-style sweep.
struct CollectivesOptions {
  std::vector<std::string> backends = {"gloo", "shm", "shm-inplace"};
  std::vector<std::string> ops = {"all_reduce", "broadcast", "all_gather", "reduce_scatter"};
  std::vector<std::string> dtypes = {"float32"};
  int64_t min_bytes = kDefaultMinBytes;
  int64_t max_bytes = kDefaultMaxBytes;
  int iters = kDefaultIters;
  int warmup = kDefaultWarmup;
  int64_t ring_bytes = kDefaultRingBytes;
  std::string csv;  // empty: none
  std::string png;  // empty: none
};

// The comparison workload (benchmarks/vs_pytorch): global batch 128, SGD with momentum 0.9.
inline constexpr int64_t kDefaultGlobalBatch = 128;
inline constexpr int kDefaultTrainSteps = 100;
inline constexpr int kDefaultTrainWarmup = 10;

// ddp-bench train: throughput and the per-step breakdown of one model.
struct TrainOptions {
  std::string model = "classic-cnn";
  int64_t global_batch = kDefaultGlobalBatch;  // over all ranks; per rank = global / world
  int steps = kDefaultTrainSteps;              // timed
  int warmup = kDefaultTrainWarmup;            // untimed, before them
  std::string backend;          // empty: InitOptions' default (DDP_BACKEND, else auto)
  std::string device = "auto";  // auto (cuda:LOCAL_RANK when CUDA is available) | cpu | cuda
  int threads = 0;              // per rank; 0: OMP_NUM_THREADS, else cores / local ranks
  int workers = 0;              // loader threads per rank; 0: batches built in the training thread
  std::string data_dir;         // empty: Debian's dataset-fashion-mnist
  uint64_t seed = 0;
  double lr = 0.01;
  double momentum = 0.9;
  bool compare = false;  // also 1 process x 1 thread and x N threads, on rank 0
  bool no_ddp = false;   // only N ranks training alone, without DDP: the ceiling
  bool lockstep = false;  // the ceiling with one barrier per step (Note [The lockstep ceiling])
  bool gradient_as_bucket_view = false;  // DDPOptions' (PyTorch's default: false)
  double bucket_cap_mb = 25;             // DDPOptions' (PyTorch's default: 25)
  bool zero = false;  // SGD as a ZeroRedundancyOptimizer: its state sharded over the ranks
  bool zero_overlap = false;  // the same, stepped in DDP's hook (overlap_with_ddp)
  // FullyShardedDataParallel instead of DDP: "" (DDP), "zero2" (a unit per child) or "zero3"
  // (the model's layers as ddp::Sharded units).
  std::string fsdp;
  // With fsdp: "bf16" gathers and computes in bf16, gradients summed in fp32 (FSDP's
  // MixedPrecision); "" (fp32) does not.
  std::string fsdp_precision;
  // none | fp16 | bf16 | powersgd (matrix_approximation_rank powersgd_rank, compressing from
  // the third step: every timed step once --warmup >= 2)
  std::string comm_hook = "none";
  int powersgd_rank = 1;
  int repeats = 1;       // rounds of all configurations, alternating; medians
  std::string label;     // first CSV column (default: the configuration)
  std::string csv;       // appended to (header when new); empty: none
  std::string png;       // empty: none
};

}  // namespace ddp::bench
