// Note [Logging] in log.h.
#include "base/log.h"

#include <poll.h>    // poll
#include <unistd.h>  // write

#include <cerrno>

namespace ddp::log {
namespace {

// One write(2) for the whole line where the kernel takes it (a pipe: whole up to PIPE_BUF); a
// non-blocking stderr (ddprun relays its workers' streams) is waited on, briefly.
void write_whole(const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(STDERR_FILENO, s.data() + done, s.size() - done);
    if (n >= 0) {
      done += static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd p{STDERR_FILENO, POLLOUT, 0};
      ::poll(&p, 1, 100);
    } else if (errno != EINTR) {
      return;  // stderr is gone: nothing else to tell
    }
  }
}

}  // namespace

void line(int rank, std::string_view text) {
  write_whole(rank >= 0 ? fmt::format("[rank {}] ddp: {}\n", rank, text)
                        : fmt::format("ddp: {}\n", text));
}

void tool(std::string_view program, std::string_view text) {
  write_whole(fmt::format("{}: {}\n", program, text));
}

bool RateLimit::admit(int64_t* suppressed) {
  MutexLock lock(&mu_);
  const auto now = std::chrono::steady_clock::now();
  if (in_window_ == 0 || now - window_start_ >= window_) {
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= burst_) {
    ++refused_;
    return false;
  }
  ++in_window_;
  if (suppressed != nullptr) *suppressed = refused_;
  refused_ = 0;
  return true;
}

void limited(RateLimit& limit, int rank, std::string_view text) {
  int64_t suppressed = 0;
  if (!limit.admit(&suppressed)) return;
  if (suppressed > 0) line(rank, fmt::format("({} similar lines left out)", suppressed));
  line(rank, text);
}

}  // namespace ddp::log
