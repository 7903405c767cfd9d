// A tensor that becomes available later: the result of a collective (Work::get_future), of a
// communication hook (ddp/comm_hooks.h), or of a chain of them (then).
//
//   ddp::Future f = pg->all_reduce(t).get_future().then([&](at::Tensor sum) {
//     return ddp::Future(pg->broadcast(sum.div_(pg->size()), 0), sum);
//   });
//   at::Tensor mean = f.wait();
//
// Thread-safety: a Future's copies share one state; wait() may be called from several threads
// (the stages run once, on the first waiter).
#pragma once

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace ddp {

class Work;

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

  // The next stage: the returned Future, once waited for, waits for this one, calls
  // `next(value)` (which may issue collectives) and waits for the Future it returns. Stages
  // run on the waiting thread (DDP's end of backward, buckets in order), so every rank issues
  // a chain's collectives in the same order: never from a completion thread, where the order
  // would depend on which collective finished first. (PyTorch runs a stage on the thread that
  // completes the future; our transports match collectives by issue order, so a stage that
  // issues one must run where every rank is at the same point. The cost: a stage overlaps
  // nothing but its own transfer.)
  Future then(std::function<Future(at::Tensor)> next) const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace ddp
