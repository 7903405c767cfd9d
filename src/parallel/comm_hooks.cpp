// The built-in communication hooks (see include/ddp/comm_hooks.h); ddp::Future is the process
// group's (src/process_group/future.cpp).
#include "ddp/comm_hooks.h"

#include <ATen/ATen.h>

#include "ddp/error.h"
#include "process_group/transport/transport.h"  // capabilities_of

namespace ddp {

namespace comm_hooks {
namespace {

// Divides by the world size in `dtype`, all-reduces, and returns the result in the bucket's
// own dtype. The division comes first so that low-precision sums do not overflow.
Future compressed_allreduce(GradBucket& bucket, at::ScalarType dtype) {
  ProcessGroup& pg = bucket.process_group();
  at::Tensor buffer = bucket.buffer();
  at::Tensor wire = buffer.to(dtype).div_(bucket.divisor());
  return Future(pg.all_reduce(wire, ReduceOp::kSum), wire, [buffer](at::Tensor reduced) {
    buffer.copy_(reduced);
    return buffer;
  });
}

}  // namespace

CommHook allreduce() {
  return [](GradBucket& bucket) {
    ProcessGroup& pg = bucket.process_group();
    at::Tensor& buffer = bucket.buffer();
    // Where the transport averages inside its reduction (shm, NCCL), the division costs no
    // extra pass over the bucket; elsewhere dividing first keeps large sums in range, as
    // PyTorch's hook does.
    if (bucket.divisor() == pg.size() && capabilities_of(pg, buffer.device().type()).native_avg) {
      return Future(pg.all_reduce(buffer, ReduceOp::kAvg), buffer);
    }
    buffer.div_(bucket.divisor());
    return Future(pg.all_reduce(buffer, ReduceOp::kSum), buffer);
  };
}

CommHook fp16_compress() {
  return [](GradBucket& bucket) { return compressed_allreduce(bucket, at::kHalf); };
}

CommHook bf16_compress() {
  return [](GradBucket& bucket) {
    ProcessGroup& pg = bucket.process_group();
    if (capabilities_of(pg, bucket.buffer().device().type()).reduces(DType::kBF16)) {
      return compressed_allreduce(bucket, at::kBFloat16);
    }
    // No bfloat16 reduction in this backend: gather every rank's bfloat16 values (their raw
    // 16-bit patterns, paired into int32 words, a type every backend moves) and sum them in
    // float32 here. Same rounding of the inputs as a bfloat16 all-reduce, exact sum.
    at::Tensor buffer = bucket.buffer();
    const int64_t n = buffer.numel();
    at::Tensor wire = at::zeros({n + (n % 2)}, buffer.options().dtype(at::kBFloat16));
    wire.narrow(0, 0, n).copy_(buffer);
    at::Tensor words = wire.view(at::kInt);
    std::vector<at::Tensor> gathered;
    for (int r = 0; r < pg.size(); ++r) gathered.push_back(at::empty_like(words));
    Work work = pg.all_gather(gathered, words);
    const int divisor = bucket.divisor();
    return Future(std::move(work), buffer, [buffer, gathered, n, divisor](at::Tensor) {
      at::Tensor sum = at::zeros({n}, buffer.options().dtype(at::kFloat));
      for (const auto& g : gathered) sum.add_(g.view(at::kBFloat16).narrow(0, 0, n).to(at::kFloat));
      buffer.copy_(sum.div_(divisor));
      return buffer;
    });
  };
}

}  // namespace comm_hooks
}  // namespace ddp
