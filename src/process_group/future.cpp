// ddp::Future (include/ddp/future.h): the value of a Work, of a comm hook, or of a chain.
#include "ddp/future.h"

#include "base/completion.h"
#include "ddp/error.h"
#include "ddp/process_group.h"  // Work

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

}  // namespace ddp
