// Force-included into every translation unit of a TSan build (DDP_SANITIZE=thread, see the top
// CMakeLists.txt): GCC 12's TSan runtime does not intercept pthread_mutex_clocklock or
// pthread_rwlock_clock{rd,wr}lock (llvm/llvm-project#62623, google/sanitizers#1620), which
// libstdc++ calls for std::timed_mutex::try_lock_until(a steady_clock deadline), as
// store::Client and DdpStore do. TSan then never sees the lock taken: it reports "unlock of an
// unlocked mutex" at every unlock, and, worse, loses the happens-before edge the mutex gives, so
// the data it guards would look raced. Without these macros libstdc++ converts the deadline to
// system_clock and calls pthread_mutex_timedlock, which TSan intercepts: every lock stays
// checked, no suppression needed. Only the deadline's clock changes, in this build alone.
#pragma once
#include <bits/c++config.h>
#undef _GLIBCXX_USE_PTHREAD_MUTEX_CLOCKLOCK
#undef _GLIBCXX_USE_PTHREAD_RWLOCK_CLOCKLOCK
