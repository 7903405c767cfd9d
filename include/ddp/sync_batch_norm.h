// SyncBatchNorm: batch normalization whose batch statistics are those of the whole global batch,
// computed over every rank of a process group (PyTorch's torch.nn.SyncBatchNorm).
//
//   auto bn = ddp::SyncBatchNorm(64);                       // where BatchNorm2d(64) would go
//   auto bn = ddp::SyncBatchNorm({.num_features = 64, .momentum = 0.01, .process_group = pg});
//   at::Tensor y = bn(x);                                    // x: [N, C, *] on this rank
//
// Plain BatchNorm on N ranks normalises each rank's b rows with their own statistics; with
// SyncBatchNorm every rank normalises with the mean and variance of all N*b rows, so N ranks x
// batch b train exactly like one process with batch N*b (DDP's contract, extended to BN models).
// Ranks may hold different batch sizes, including none: each contributes its row count.
//
// Input: [N, C], [N, C, L], [N, C, H, W] or [N, C, D, H, W] alike (it replaces BatchNorm1d, 2d
// and 3d); statistics are per channel over every other dimension.
//
// Parameters and buffers are those of torch::nn::BatchNorm{1,2,3}d, with the same names and
// initial values (weight = 1, bias = 0, running_mean = 0, running_var = 1,
// num_batches_tracked = 0), so state dicts and checkpoints are interchangeable both ways.
//
// Collective contract (train mode): each forward is a collective (an all_gather of per-rank
// count, mean and variance) and each backward through it is another (an all_reduce of the
// per-channel sums of dy and dy*(x - mean)), both on the module's process group. Every rank
// must therefore run the same number of train-mode forwards through each SyncBatchNorm, in the
// same order relative to the group's other collectives, and backpropagate through all of them
// or through none; a rank that skips one leaves the others waiting until the group's timeout
// (ddp::TimeoutError, which names this module). PyTorch has the same contract.
// No communication happens, and the module is exactly torch::nn::BatchNorm, when:
//   - the module is in eval mode (running statistics are used; with track_running_stats =
//     false each rank uses its own batch statistics, as PyTorch does);
//   - the group has one rank, or process_group is null and no default group exists.
//
// Gradients: the input gradient is the exact gradient of the sum of all ranks' losses; weight
// and bias gradients are local (this rank's rows only), and DistributedDataParallel averages
// them like any other parameter's. Running statistics are updated identically on every rank
// with the global mean and the unbiased global variance, so DDP's broadcast_buffers changes
// nothing.
//
// Errors (ddp::Error, on every rank alike, never a hang): an input whose channel count is not
// num_features or that has fewer than 2 dimensions (the rank with the bad input describes it,
// the others name that rank), and, in training, fewer than 2 values per channel over all ranks
// together (PyTorch's "Expected more than 1 value per channel when training").
//
// Thread-safety: like any torch::nn::Module, one module is driven by one thread.
//
// Note [Converting a model to SyncBatchNorm]
// In C++ a parent module calls its children through its own member variables (bn1(x)), not
// through the registry that named_children() lists, so no function can rewire an arbitrary
// user module: replacing a registry entry would leave the member calling the old BatchNorm.
// Two patterns work:
//   1. Construct SyncBatchNorm where BatchNorm would go. At world size 1 it *is* BatchNorm, so
//      many models can use it unconditionally. To choose by a flag, hold the layer as an
//      AnyModule:
//        struct Block : torch::nn::Module {
//          Block(int64_t c, bool sync) {
//            bn = sync ? torch::nn::AnyModule(ddp::SyncBatchNorm(c))
//                      : torch::nn::AnyModule(torch::nn::BatchNorm2d(c));
//            register_module("bn", bn.ptr());     // same state-dict names either way
//          }
//          at::Tensor forward(const at::Tensor& x) { return bn.forward(x); }
//          torch::nn::AnyModule bn;
//        };
//   2. A model that is a torch::nn::Sequential of layers is converted by
//      convert_sync_batchnorm() below, which rebuilds the Sequential.
// LibTorch cannot nest a plain Sequential in another (AnyModule needs a non-template
// forward()), so nested blocks are subclasses of SequentialImpl with a forward() of their own:
// user code, which the converter leaves alone and refuses to convert around (pattern 1 there).
// Convert (or construct) before creating the optimizer: the new layers have new parameters.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>

#include <torch/nn/cloneable.h>                     // torch::nn::Cloneable
#include <torch/nn/modules/container/sequential.h>  // torch::nn::Sequential
#include <torch/nn/pimpl.h>                         // torch::nn::ModuleHolder

#include "ddp/process_group.h"

namespace ddp {

struct SyncBatchNormOptions {
  // C: the size of the input's dimension 1.
  int64_t num_features = 0;
  // Added to the variance for numerical stability (BatchNorm's default).
  double eps = 1e-5;
  // Weight of the new batch statistic in the running statistics (BatchNorm's default);
  // std::nullopt uses the cumulative average 1 / num_batches_tracked instead.
  std::optional<double> momentum = 0.1;
  // Learn a per-channel scale (weight) and shift (bias).
  bool affine = true;
  // Keep running_mean / running_var for eval mode; without them eval mode normalises each
  // rank's batch with its own statistics.
  bool track_running_stats = true;
  // The ranks whose batches form the global batch; null means the default group
  // (ddp::init_process_group()), looked up at each forward, or none (world size 1).
  std::shared_ptr<ProcessGroup> process_group;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(int64_t num_features);
  explicit SyncBatchNormImpl(SyncBatchNormOptions options);

  // x: [N, C, *] -> same shape. In train mode with more than one rank, a collective (see top).
  at::Tensor forward(const at::Tensor& x);

  // (Re)creates parameters and buffers with their initial values (Cloneable's contract).
  void reset() override;
  // running_mean = 0, running_var = 1, num_batches_tracked = 0.
  void reset_running_stats();
  // reset_running_stats(), weight = 1, bias = 0.
  void reset_parameters();

  void pretty_print(std::ostream& stream) const override;

  // The group this module reduces over at its next forward (options.process_group, else the
  // default group), or null when there is none.
  std::shared_ptr<ProcessGroup> group() const;

  SyncBatchNormOptions options;

  // Same names, shapes and meaning as torch::nn::BatchNorm's; undefined when affine
  // (weight, bias) or track_running_stats (the three buffers) is off.
  at::Tensor weight;               // [C]
  at::Tensor bias;                 // [C]
  at::Tensor running_mean;         // [C]
  at::Tensor running_var;          // [C], unbiased
  at::Tensor num_batches_tracked;  // [] int64: train-mode forwards so far
};

// TORCH_MODULE(SyncBatchNorm), plus a constructor from the options so that designated
// initializers work: ddp::SyncBatchNorm({.num_features = 64, .eps = 1e-3}).
class SyncBatchNorm : public torch::nn::ModuleHolder<SyncBatchNormImpl> {
 public:
  using torch::nn::ModuleHolder<SyncBatchNormImpl>::ModuleHolder;
  using Impl = SyncBatchNormImpl;
  SyncBatchNorm(SyncBatchNormOptions options)  // NOLINT(google-explicit-constructor)
      : ModuleHolder(std::make_shared<SyncBatchNormImpl>(std::move(options))) {}
};

// Returns a new Sequential with the same children under the same names, except that every
// torch::nn::BatchNorm1d/2d/3d becomes a SyncBatchNorm over `group` with the BatchNorm's
// options, train/eval mode and a copy of its parameters and buffers (same values, dtype,
// device and requires_grad). Every other child is kept as is: the same module object, shared
// with `seq`. `seq` itself is not modified; the result's own train/eval mode is `seq`'s.
//
// Throws ddp::Error, naming the layer, when a kept child (a user module, including a
// SequentialImpl subclass used as a nested block) contains a BatchNorm: the converter cannot
// rewire it (Note [Converting a model to SyncBatchNorm]) and a silently unsynchronised
// BatchNorm would train differently; also when `seq` holds a subclass of SequentialImpl,
// whose own forward() a plain Sequential would not reproduce.
torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& seq,
                                             std::shared_ptr<ProcessGroup> group = nullptr);

}  // namespace ddp
