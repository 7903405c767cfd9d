// Clang's thread-safety annotations (no-ops elsewhere) and a mutex and condition variable that
// carry them, as LevelDB's port/thread_annotations.h and port.h. Every class of ours with a
// mutex uses these (scripts/check-thread-safety.sh fails on a std::mutex member elsewhere). scripts/check-thread-safety.sh (ctest:
// test_thread_safety) compiles the annotated files with clang -Wthread-safety -Werror.
//
//   mutable Mutex mu_;
//   int pending_ GUARDED_BY(mu_);
//   void step() EXCLUDES(mu_) { MutexLock lock(&mu_); ++pending_; }
#pragma once

#include <condition_variable>
#include <mutex>
#include <utility>

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

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis that the caller holds the mutex (code reached through a callback the
  // analysis cannot follow, run by a thread that took the lock); checks nothing at run time.
  void assert_held() const ASSERT_CAPABILITY(this) {}

 private:
  std::mutex mu_;
};

// A condition variable over a Mutex, as LevelDB's port::CondVar: waits release and retake it.
class CondVar {
 public:
  explicit CondVar(Mutex* mu) : mu_(mu) {}
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Callers hold *mu_; it is released while waiting and held again on return.
  void wait() NO_THREAD_SAFETY_ANALYSIS { cv_.wait(*mu_); }
  template <typename Predicate>
  void wait(Predicate ready) NO_THREAD_SAFETY_ANALYSIS {
    cv_.wait(*mu_, std::move(ready));
  }
  template <typename Duration>
  void wait_for(Duration d) NO_THREAD_SAFETY_ANALYSIS {
    cv_.wait_for(*mu_, d);
  }
  template <typename Duration, typename Predicate>
  bool wait_for(Duration d, Predicate ready) NO_THREAD_SAFETY_ANALYSIS {
    return cv_.wait_for(*mu_, d, std::move(ready));
  }
  void signal() { cv_.notify_one(); }
  void signal_all() { cv_.notify_all(); }

 private:
  Mutex* const mu_;
  std::condition_variable_any cv_;
};

class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->lock(); }
  ~MutexLock() RELEASE() { mu_->unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

}  // namespace ddp
