// Completion: the one async primitive behind ddp::Work and ddp::Future. Something finishes
// later; a completion step (wait for the transport, then a local transform) runs exactly once,
// in the first wait() that gets the lock, and its outcome is sticky: every later wait() returns
// at once, or rethrows the same error. A step that throws is finished too; it is never retried,
// so a transform is applied once or not at all. Torch-free.
//
//   Completion done;
//   done.run([&] { transport.wait(); value = transform(value); });  // step runs once
//   done.run(...);  // returns, or rethrows the first run's error
#pragma once

#include <atomic>
#include <exception>
#include <utility>

#include "base/thread_annotations.h"

namespace ddp {

class Completion {
 public:
  // Runs `step` unless a previous run finished (even by throwing); then rethrows the stored
  // error, if any. `classify(std::exception_ptr)` maps the step's exception to the error to
  // store (identity by default). Concurrent callers block until the first one is done.
  template <typename Step>
  void run(Step&& step) {
    run(std::forward<Step>(step), [](std::exception_ptr e) { return e; });
  }
  template <typename Step, typename Classify>
  void run(Step&& step, Classify&& classify) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (!finished_.load(std::memory_order_relaxed)) {
      try {
        step();
      } catch (...) {
        error_ = classify(std::current_exception());
      }
      finished_.store(true, std::memory_order_release);
    }
    if (error_) std::rethrow_exception(error_);
  }

  // Whether a run has finished; never blocks (a wait() in progress holds the lock).
  bool finished() const { return finished_.load(std::memory_order_acquire); }

 private:
  mutable Mutex mu_;
  std::atomic<bool> finished_{false};  // written under mu_
  std::exception_ptr error_ GUARDED_BY(mu_);
};

}  // namespace ddp
