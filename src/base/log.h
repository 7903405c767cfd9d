// The one sink for the lines ddp-cpp prints on its own (notes, debug output, warnings), as
// opposed to a tool's user-facing output (tables, the progress bar) and to errors, which are
// exceptions. Torch-free.
//
// Note [Logging]
// Every line goes to stderr in one write(2), whole, so that the lines of ranks (threads or
// processes) sharing a terminal never interleave mid-line, and carries who wrote it:
//   "[rank 3] ddp: process group 'default' of 4 ranks over shm" (the library; rank < 0: "ddp: ")
//   "ddprun: ..." / "ddp-train: ..." (a tool's own notes: log::tool)
// The rank is passed by the caller, not kept in a global: tests run several ranks as threads of
// one process. A line that can repeat without bound (a per-iteration debug line, an intruder
// knocking at the store) goes through a RateLimit: at most `burst` lines a window, then one line
// that counts what was left out.
// Not routed here: writes between fork and exec (ddprun's process.cpp: only async-signal-safe
// calls there); ddp-train's and ddp-bench's own output (the progress bar, tables, the final
// error line), which build on the public API alone, as a user's program would.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "base/thread_annotations.h"

namespace ddp::log {

// Writes `text` (no trailing newline) as one line: "[rank R] ddp: text", or "ddp: text".
void line(int rank, std::string_view text);
// A tool's own note: "<program>: text".
void tool(std::string_view program, std::string_view text);

template <typename... Args>
void note(int rank, fmt::format_string<Args...> format, Args&&... args) {
  line(rank, fmt::format(format, std::forward<Args>(args)...));
}

// Admits at most `burst` lines per `window`; the first line admitted after a window in which
// some were refused is preceded by a count of them (suppressed_line()).
class RateLimit {
 public:
  RateLimit(int burst, std::chrono::milliseconds window) : burst_(burst), window_(window) {}
  // True when a line may be written now. When it returns true and lines were refused since
  // the last admitted one, `suppressed` receives their number (else 0).
  bool admit(int64_t* suppressed = nullptr) EXCLUDES(mu_);

 private:
  const int burst_;
  const std::chrono::milliseconds window_;
  Mutex mu_;
  std::chrono::steady_clock::time_point window_start_ GUARDED_BY(mu_);
  int in_window_ GUARDED_BY(mu_) = 0;
  int64_t refused_ GUARDED_BY(mu_) = 0;
};

// line(), through `limit`: refused lines are counted, and the count precedes the next one.
void limited(RateLimit& limit, int rank, std::string_view text);

}  // namespace ddp::log
