// Clang's thread-safety annotations (no-ops elsewhere) and a mutex that carries them, as
// LevelDB's port/thread_annotations.h. scripts/check-thread-safety.sh (ctest:
// test_thread_safety) compiles the annotated files with clang -Wthread-safety -Werror.
//
//   mutable Mutex mu_;
//   int pending_ GUARDED_BY(mu_);
//   void step() EXCLUDES(mu_) { MutexLock lock(&mu_); ++pending_; }
#pragma once

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
#define NO_THREAD_SAFETY_ANALYSIS DDP_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace ddp {

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }

 private:
  std::mutex mu_;
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
