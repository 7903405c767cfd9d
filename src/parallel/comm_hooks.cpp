// Futures and the built-in communication hooks (see include/ddp/comm_hooks.h).
#include "ddp/comm_hooks.h"

#include <ATen/ATen.h>

#include "base/completion.h"
#include "ddp/error.h"
#include "process_group/transport/transport.h"  // capabilities_of

namespace ddp {

// A Future is a Work, a value, and a transform applied once when the work completes: the
// same Completion as Work's (src/base/completion.h), so the outcome, error included, is sticky.
// A chained Future (then(next)) has a parent instead of a Work.
//
// Note [Chained futures]
// PyTorch runs a future's callbacks on whichever thread completes it (a Gloo worker, a CUDA
// callback), so a hook's second collective is issued at a time, and by a thread, that differ
// from rank to rank. Our transports match collectives by the order each rank issues them (the
// shm slots, Gloo's tags), so a stage that issues a collective must run at a point that is the
// same on every rank: when the Future is waited for. DDP waits for its buckets in order at the
// end of backward, so a PowerSGD bucket issues [uncompressed, P, Q], the first during
// backward and the other two at its turn in that wait, on every rank alike. What this costs:
// a bucket's later stages do not overlap backward (they overlap nothing but their own
// transport), which for PowerSGD is two small all-reduces per bucket.
struct Future::State {
  Work work;  // may be empty (already completed)
  bool has_work = false;
  at::Tensor value;                            // written by `done`'s step only
  std::function<at::Tensor(at::Tensor)> then;  // run by `done`'s step only
  std::shared_ptr<State> parent;               // a chained stage: wait for it, then `next`
  std::function<Future(at::Tensor)> next;
  bool chained = false;  // constant: is_completed() reads it while wait() moves `parent`
  Completion done;
};

Future Future::completed(at::Tensor value) {
  Future f;
  f.state_ = std::make_shared<State>();
  f.state_->value = std::move(value);
  return f;
}

Future::Future(Work work, at::Tensor value, std::function<at::Tensor(at::Tensor)> then)
    : state_(std::make_shared<State>()) {
  state_->work = std::move(work);
  state_->has_work = true;
  state_->value = std::move(value);
  state_->then = std::move(then);
}

at::Tensor Future::wait() {
  if (!state_) throw Error("ddp::Future::wait() on an empty Future");
  State& s = *state_;
  s.done.run([&s] {
    if (s.parent) {
      Future parent;
      parent.state_ = std::move(s.parent);
      auto next = std::move(s.next);
      s.value = next(parent.wait()).wait();
      return;
    }
    if (s.has_work) s.work.wait();  // rethrows the collective's error
    if (s.then) {
      auto then = std::move(s.then);
      s.value = then(s.value);
    }
  });
  return s.value;
}

bool Future::is_completed() const {
  if (!state_) return false;
  if (state_->done.finished()) return true;
  if (state_->chained) return false;  // its next stage has not even run
  return !state_->has_work || state_->work.is_completed();
}

Future Future::then(std::function<Future(at::Tensor)> next) const {
  if (!state_) throw Error("ddp::Future::then() on an empty Future");
  Future f;
  f.state_ = std::make_shared<State>();
  f.state_->parent = state_;
  f.state_->chained = true;
  f.state_->next = std::move(next);
  return f;
}

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
    if (bucket.divisor() == pg.size() && capabilities_of(pg).native_avg) {
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
    if (capabilities_of(pg).reduces(DType::kBF16)) {
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
