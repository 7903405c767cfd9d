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
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ddp/process_group.h"

namespace ddp {

// A tensor that becomes available later: the result of a collective, optionally transformed.
class Future {
 public:
  Future() = default;
  // Already available.
  static Future completed(at::Tensor value);
  // `value` is ready once `work` completes; then `then(value)` (if given) makes the result.
  Future(Work work, at::Tensor value, std::function<at::Tensor(at::Tensor)> then = {});

  // Blocks until available; rethrows the collective's error. Idempotent: the transform runs
  // once, and if it (or the collective) failed, every later wait() rethrows the same error.
  at::Tensor wait();
  bool is_completed() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

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

}  // namespace comm_hooks
}  // namespace ddp
