// Communication hooks: how a bucket of gradients is turned into the average over ranks.
//
//   model.register_comm_hook(ddp::comm_hooks::fp16_compress());
//   model.register_comm_hook([](ddp::GradBucket& b) {        // your own
//     b.buffer().div_(b.divisor());
//     return ddp::Future(b.process_group().all_reduce(b.buffer()), b.buffer());
//   });
//
// A hook receives a bucket whose buffer() holds this rank's gradients (the sum over this rank's
// micro-batches, not divided by anything) and returns a Future whose value, once waited for, is
// a tensor shaped and typed like buffer() holding the value every rank must use (normally the
// mean over ranks: the sum divided by divisor()). Hooks run during backward, as soon as the
// bucket is ready; the Future is waited for at the end of backward. Every rank must issue the
// same collectives in the same order. Built-ins mirror PyTorch's
// torch.distributed.algorithms.ddp_comm_hooks.
//
// A hook runs while DDP holds its lock: it may use its GradBucket and the process group, but
// must not call back into the wrapper (a forward or backward through it, its bucket layout or
// order, register_comm_hook): such a call throws ddp::Error naming it, instead of deadlocking.
#pragma once

#include <functional>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ddp/future.h"  // Future: what a hook returns
#include "ddp/process_group.h"

namespace ddp {

class GradBucket {
 public:
  GradBucket(size_t index, bool is_last, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<at::Tensor> parameters, ProcessGroup& group, int divisor)
      : index_(index), is_last_(is_last), buffer_(std::move(buffer)),
        gradients_(std::move(gradients)), parameters_(std::move(parameters)), group_(group),
        divisor_(divisor) {}

  size_t index() const { return index_; }
  bool is_last() const { return is_last_; }
  // Flat, contiguous: this bucket's gradients back to back (dtype of its parameters).
  at::Tensor& buffer() { return buffer_; }
  // Views into buffer(), one per parameter, shaped like it.
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  ProcessGroup& process_group() { return group_; }
  // How many ranks' gradients the sum stands for: the group size, or under ddp::Join the
  // ranks still training (unless divide_by_initial_world_size). Divide by it for the mean.
  int divisor() const { return divisor_; }

 private:
  size_t index_;
  bool is_last_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<at::Tensor> parameters_;
  ProcessGroup& group_;
  int divisor_;
};

using CommHook = std::function<Future(GradBucket&)>;

namespace comm_hooks {

// Mean over ranks in the bucket's dtype (the default).
CommHook allreduce();
// Divides by the world size, casts to float16, all-reduces, casts back: half the bytes on the
// wire, float16 precision (and range: the division first keeps sums from overflowing).
CommHook fp16_compress();
// Same with bfloat16: float32's range, 8 bits of mantissa. Backends without bfloat16
// reductions (Gloo in LibTorch 1.13) all-gather the bfloat16 values and sum them in float32
// on every rank: each rank receives (N-1)/2 float32-buckets' worth of bytes, N/4 of a float32
// ring all-reduce (half at 2 ranks, equal at 4, more beyond). NCCL reduces bfloat16 natively.
CommHook bf16_compress();

// PowerSGD (Vogels et al., NeurIPS 2019), as PyTorch's powerSGD_hook with the same parameters
// and the same arithmetic (bitwise equal to PyTorch's hook under PyTorch's DDP on the same
// gradients):
//
//   auto state = std::make_shared<ddp::comm_hooks::PowerSGDState>(
//       ddp::comm_hooks::PowerSGDOptions{.matrix_approximation_rank = 2,
//                                        .start_powerSGD_iter = 100});
//   model.register_comm_hook(ddp::comm_hooks::powerSGD_hook(state));
//   training_state.add("powersgd", *state);  // checkpoints: error feedback, P, Q, iteration
//
// Until start_powerSGD_iter iterations have passed, buckets are all-reduced as usual. Then
// each gradient viewed as an n x m matrix M (its first dimension by the rest) with
// (n + m) * rank * min_compression_rate < n * m is sent as two all-reduced factors P = MQ
// (n x rank) and Q = M^T P (m x rank, after orthogonalizing P); M becomes P Q^T / world. Other
// gradients (biases, small matrices) are all-reduced together, uncompressed. Error feedback
// adds what compression lost on this rank to the next iteration's gradient; warm start reuses
// the previous Q instead of a fresh random one (drawn from a seed that is the same on every
// rank: random_seed, then numpy's RandomState sequence, as PyTorch draws it).
struct PowerSGDOptions {
  int matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;  // > 1 with error feedback or warm start (ConfigError)
  double min_compression_rate = 2;
  bool use_error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0;  // e.g. 1e-8 when a gradient column may be all zero
  uint32_t random_seed = 0;
  bool batch_tensors_with_same_shape = false;  // one batched matmul per shape in a bucket
};

// The hook's state across iterations: one per model, used by one hook. Not thread-safe
// beyond what DDP does (the hook runs under DDP's lock; save/load it between iterations).
class PowerSGDState {
 public:
  explicit PowerSGDState(PowerSGDOptions options = {});  // ConfigError on bad options
  ~PowerSGDState();
  PowerSGDState(const PowerSGDState&) = delete;
  PowerSGDState& operator=(const PowerSGDState&) = delete;

  const PowerSGDOptions& options() const;
  // Iterations seen so far (counted at each iteration's last bucket, as PyTorch's state.iter).
  int64_t iter() const;
  struct CompressionStats {
    double rate = 0;  // before / after; 0 before compression starts
    int64_t numel_before = 0;
    int64_t numel_after = 0;
  };
  CompressionStats compression_stats() const;

  // This rank's state (iteration, generator, per bucket: error feedback, P and Q) as bytes,
  // and back. load_state_dict checks everything before it changes anything: ddp::Error naming
  // what does not fit (other options, a malformed state). keep_error_feedback = false drops
  // the per-rank errors (a resume at another world size: another rank's error is not ours).
  std::string state_dict() const;
  void load_state_dict(const std::string& bytes, bool keep_error_feedback = true);

 private:
  friend CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state);

}  // namespace comm_hooks
}  // namespace ddp
