// Writing under a file-size limit (see file_size_limit.h).
#include "base/file_size_limit.h"

#include <pthread.h>       // pthread_sigmask
#include <sys/resource.h>  // getrlimit(RLIMIT_FSIZE)

#include <ctime>  // timespec

#include <fmt/format.h>

namespace ddp::base {

FileSizeSignalBlocked::FileSizeSignalBlocked() {
  sigemptyset(&xfsz_);
  sigaddset(&xfsz_, SIGXFSZ);
  ::pthread_sigmask(SIG_BLOCK, &xfsz_, &previous_);
}

FileSizeSignalBlocked::~FileSizeSignalBlocked() {
  if (sigismember(&previous_, SIGXFSZ)) return;  // the caller blocks it: theirs to handle
  const timespec no_wait{};
  while (::sigtimedwait(&xfsz_, nullptr, &no_wait) == SIGXFSZ) {
  }
  ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
}

std::string file_too_large_reason(std::uint64_t bytes) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return fmt::format("the file system refuses a file of {} bytes", bytes);
  }
  const auto max = static_cast<std::uint64_t>(limit.rlim_cur);
  return fmt::format(
      "this process may write files of at most {} bytes (ulimit -f {}) and this "
      "one needs {}; raise the limit (ulimit -f unlimited)",
      max, max / 1024, bytes);
}

}  // namespace ddp::base
