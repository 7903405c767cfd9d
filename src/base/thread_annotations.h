// Clang's thread-safety annotations (no-ops elsewhere) and the mutexes and condition variable
// that carry them, as LevelDB's port/thread_annotations.h and port.h. Every class of ours with a
// mutex uses these: scripts/check-thread-safety.sh (ctest: test_thread_safety) fails when a
// std::mutex, std::timed_mutex, std::recursive_mutex, std::shared_mutex or
// std::condition_variable is declared anywhere in src/ or tools/ but here, then compiles every
// annotated file with clang -Wthread-safety -Werror.
//
//   mutable Mutex mu_;
//   CondVar changed_{&mu_};
//   int pending_ GUARDED_BY(mu_);
//   void step() EXCLUDES(mu_) { MutexLock lock(&mu_); ++pending_; changed_.signal_all(); }
//   void take() EXCLUDES(mu_) { MutexLock lock(&mu_); while (pending_ == 0) changed_.wait(); }
//
// Wait in a loop over the condition, as above, not with a predicate lambda: the analysis checks
// a lambda's body apart from its caller and does not know that the lock is held there.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define DDP_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define DDP_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) DDP_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY DDP_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) DDP_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) DDP_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) DDP_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) DDP_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) DDP_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define EXCLUDES(...) DDP_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define TRY_ACQUIRE(...) DDP_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) DDP_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS DDP_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace ddp {

class CondVar;

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis that the caller holds the mutex (code reached through a callback the
  // analysis cannot follow, run by a thread that took the lock); checks nothing at run time.
  void assert_held() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;  // waits on mu_ itself: a std::condition_variable, no second mutex
  std::mutex mu_;
};

// A mutex whose lock can wait until a deadline (store calls, each bounded by its deadline).
// A std::timed_mutex inside: TSan builds (DDP_SANITIZE=thread) force-include
// cmake/tsan_timed_locks.h so that its try_lock_until() takes a lock TSan intercepts.
class CAPABILITY("mutex") TimedMutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  template <typename Clock, typename Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& deadline) TRY_ACQUIRE(true) {
    return mu_.try_lock_until(deadline);
  }
  void assert_held() const ASSERT_CAPABILITY(this) {}

 private:
  std::timed_mutex mu_;
};

// A condition variable over a Mutex, as LevelDB's port::CondVar: waits release and retake it.
// The analysis cannot tie *mu_ to the caller's mutex, so the waits carry no annotation: callers
// hold *mu_ (a GUARDED_BY read in their loop's condition says so to the analysis).
class CondVar {
 public:
  explicit CondVar(Mutex* mu) : mu_(mu) {}
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Callers hold *mu_; it is released while waiting and held again on return. Wakes may be
  // spurious: wait in a loop over the condition.
  void wait() {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  template <typename Rep, typename Period>
  std::cv_status wait_for(const std::chrono::duration<Rep, Period>& d) {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    const std::cv_status status = cv_.wait_for(lock, d);
    lock.release();
    return status;
  }
  template <typename Clock, typename Duration>
  std::cv_status wait_until(const std::chrono::time_point<Clock, Duration>& deadline) {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    const std::cv_status status = cv_.wait_until(lock, deadline);
    lock.release();
    return status;
  }
  void signal() { cv_.notify_one(); }
  void signal_all() { cv_.notify_all(); }

 private:
  Mutex* const mu_;
  std::condition_variable cv_;
};

// Holds a mutex for its scope: takes it, or adopts one a successful try_lock() or
// try_lock_until() took (`if (!mu_.try_lock()) return; MutexLock lock(&mu_, std::adopt_lock);`).
template <typename M>
class SCOPED_CAPABILITY BasicMutexLock {
 public:
  explicit BasicMutexLock(M* mu) ACQUIRE(mu) : mu_(mu) { mu_->lock(); }
  BasicMutexLock(M* mu, std::adopt_lock_t) REQUIRES(mu) : mu_(mu) {}
  ~BasicMutexLock() RELEASE() { mu_->unlock(); }
  BasicMutexLock(const BasicMutexLock&) = delete;
  BasicMutexLock& operator=(const BasicMutexLock&) = delete;

 private:
  M* const mu_;
};
using MutexLock = BasicMutexLock<Mutex>;
using TimedMutexLock = BasicMutexLock<TimedMutex>;

}  // namespace ddp
