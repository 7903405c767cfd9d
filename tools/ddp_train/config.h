// ddp-train's configuration: every flag, its default and its meaning, in one struct.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp::train {

// The closed choices of a flag, each with its name on the command line and in hparams.
enum class Optimizer { kAdamW, kSgd };
enum class Precision { kFp32, kBf16, kFp16 };
enum class Device { kAuto, kCpu, kCuda };
enum class CommHook { kNone, kFp16, kBf16, kPowerSGD };

template <typename E>
using Names = std::array<std::pair<std::string_view, E>, 3>;
inline constexpr std::array<std::pair<std::string_view, Optimizer>, 2> kOptimizerNames = {
    {{"adamw", Optimizer::kAdamW}, {"sgd", Optimizer::kSgd}}};
inline constexpr Names<Precision> kPrecisionNames = {
    {{"fp32", Precision::kFp32}, {"bf16", Precision::kBf16}, {"fp16", Precision::kFp16}}};
inline constexpr Names<Device> kDeviceNames = {
    {{"auto", Device::kAuto}, {"cpu", Device::kCpu}, {"cuda", Device::kCuda}}};
inline constexpr std::array<std::pair<std::string_view, CommHook>, 4> kCommHookNames = {
    {{"none", CommHook::kNone},
     {"fp16", CommHook::kFp16},
     {"bf16", CommHook::kBf16},
     {"powersgd", CommHook::kPowerSGD}}};

std::string_view to_string(Optimizer v);
std::string_view to_string(Precision v);
std::string_view to_string(Device v);
std::string_view to_string(CommHook v);

// Defaults chosen so that `ddprun --standalone --nproc-per-node 2 ddp-train` clears 90% test
// accuracy on Fashion-MNIST in a few minutes on a 2-core machine (see the README).
struct TrainConfig {
  // Model and data.
  std::string model = "cnn";  // a name of tools/common's model registry: mlp | cnn | resnet
  std::string data_dir;       // Fashion-MNIST folder; empty: Debian's dataset-fashion-mnist
  int64_t train_subset = 0;   // use the first N training images (0: all 60000)
  int64_t test_subset = 0;    // evaluate on the first N test images (0: all 10000)
  // Optimisation.
  int64_t epochs = 3;
  int64_t batch_size = 64;                  // per rank and per micro-batch
  int grad_accum = 1;                       // micro-batches per optimizer step (no_sync in between)
  Optimizer optimizer = Optimizer::kAdamW;  // sgd: with momentum
  double lr = 1e-3;            // measured: 90.9% after 3 epochs at 2 ranks (SGD 0.05: 90.1%)
  double momentum = 0.9;       // SGD only
  double weight_decay = 0.01;  // decoupled (AdamW) / L2 (SGD)
  double warmup_epochs = 0.3;  // linear warmup, then cosine decay to 0
  bool scale_lr = false;       // lr *= world size (linear scaling rule)
  Precision precision = Precision::kFp32;  // bf16: autocast; fp16: CUDA, grad scaler
  bool sync_bn = false;                    // BatchNorm statistics over all ranks
  bool zero = false;  // optimizer state sharded over the ranks (ddp::ZeroRedundancyOptimizer)
  // FullyShardedDataParallel instead of DDP: "" (DDP), "zero2" or "zero3" (the model's layers
  // as ddp::Sharded units).
  std::string fsdp;
  // "full": one file, written by rank 0 (the model whole); "sharded": each rank its own file in a
  // checkpoint directory (CheckpointerOptions::sharded). Empty: sharded with --fsdp, else full.
  std::string checkpoint_format;
  uint64_t seed = 0;
  int64_t max_steps = 0;  // stop after this many optimizer steps (0: run all epochs)
  // Each optimizer step lasts at least this long: the rank sleeps out the rest (0: no floor). A
  // slow job that leaves the CPUs idle, for failure drills, demos and the multi-host tests.
  int min_step_ms = 0;
  // Execution.
  Device device = Device::kAuto;  // auto: cuda:LOCAL_RANK when CUDA is available
  int threads = 0;                // intra-op threads per rank (0: OMP_NUM_THREADS or cores/ranks)
  int workers = 1;                // loader threads per rank
  CommHook comm_hook = CommHook::kNone;  // fp16 / bf16: gradients all-reduced compressed
  int powersgd_rank = 1;                 // --comm-hook powersgd[:RANK]
  int64_t powersgd_start = 1000;         // plain all-reduce before this iteration (PyTorch's)
  // Output.
  std::string output_dir;  // empty: runs/<name>/version_N (the next free N; with --resume
                           // auto, the newest existing one)
  std::string name = "ddp-train";
  std::string resume;            // "" (fresh), "auto" (newest valid checkpoint, if any), a path
  int64_t checkpoint_every = 0;  // optimizer steps between checkpoints (0: each epoch only)
  int keep = 3;                  // step checkpoints kept besides last.ckpt
  int64_t log_every = 50;        // optimizer steps between progress lines (non-terminal output)
  bool plots = true;             // PNG curves at the end (gnuplot)
  std::string sample_log;        // a folder: each rank logs the samples of each step it trains
  // Fault tolerance (--ft, under ddprun --ft): each step under ddp::ft::Manager; a failed
  // replica costs the step, the others go on and heal it when it returns.
  bool ft = false;
  int ft_min_replicas = 1;  // the fewest replicas a quorum trains with

  nlohmann::json to_json() const;
};

// Parses ddp-train's command line. Returns false when --help was printed (exit 0). Throws
// ddp::ConfigError naming the flag and the fix for bad flags or values.
bool parse_args(int argc, char** argv, TrainConfig& config);

}  // namespace ddp::train
