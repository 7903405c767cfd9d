// Where the workers' output goes, and where their files live.
//
//   - note(): ddprun's own messages, one "ddprun: ..." line each on stderr.
//   - Stream: one worker stream (stdout or stderr), from its pipe to the console as whole lines
//     prefixed "[rank N]: ", to its log file as raw bytes and, for stderr, to a tail of recent
//     lines kept for the failure summary.
//   - RunDirectory: DIR/<run_id>_<random>/attempt_<k>/<local_rank>/ (torchrun's layout), which
//     holds each worker's stdout.log, stderr.log and error.json (TORCHELASTIC_ERROR_FILE).
//
// A console that goes away (EPIPE) is dropped quietly: it must never stop the workers.
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <string_view>
#include <utility>  // std::move

#include "launch_config.h"  // LaunchConfig
#include "process.h"  // UniqueFd

namespace ddp::launcher {

// Last lines of a worker's stderr kept for the failure summary.
inline constexpr int kStderrTailLines = 10;
// A line longer than this is shown in pieces rather than buffered without bound.
inline constexpr std::size_t kMaxLineBytes = 64 * 1024;

// Writes all of `data`, waiting out EINTR/EAGAIN. Returns false when the fd is gone (EPIPE...).
bool write_all(int fd, std::string_view data);

// "ddprun: <line>\n" on stderr.
void note(const std::string& line);

class Stream {
 public:
  // `console_fd`: STDOUT_FILENO / STDERR_FILENO, or -1 when this stream is not shown.
  // `file`: the log file, or empty. `tail_lines`: how many last lines to keep (0: none).
  Stream(std::string prefix, int console_fd, UniqueFd file, std::size_t tail_lines);

  void attach(UniqueFd read_end) { pipe_ = std::move(read_end); }  // non-blocking
  int fd() const { return pipe_.get(); }                           // -1 once closed
  const std::deque<std::string>& tail() const { return tail_; }

  // Reads what the pipe holds (bounded, so one chatty worker cannot starve the others); closes
  // it at EOF.
  void pump();

  // Reads everything left, then flushes a partial last line. For the end of an attempt, when
  // no writer is left (a pipe kept open by an escaped process yields EAGAIN, and we stop).
  void drain();

 private:
  void read_some(int max_chunks);
  void feed(std::string_view chunk);
  void emit_line(std::string_view line, std::string& out);
  void write_console(const std::string& out);

  // Constant after construction.
  const std::string prefix_;  // "[rank 3]: "
  UniqueFd file_;             // the log file, or -1
  const std::size_t tail_lines_;

  // Changes as output flows.
  int console_fd_;       // -1 when not shown, or once the console is gone
  UniqueFd pipe_;        // read end; -1 once closed
  std::string partial_;  // bytes after the last '\n'
  std::deque<std::string> tail_;
};

// The run's directory. Under config.log_dir, or a fresh temporary directory when there is none;
// a temporary one that holds no logs (only error files) is removed with this object.
class RunDirectory {
 public:
  // Throws ConfigError when --log-dir cannot be created, ddp::Error when the directory cannot.
  RunDirectory(const LaunchConfig& config, const std::string& run_id);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return path_; }

  // Creates and returns <path>/attempt_<attempt>/<local_rank>.
  std::string rank_dir(int attempt, int local_rank) const;

 private:
  std::string path_;
  bool keep_ = true;
};

// A log file, created or truncated.
UniqueFd open_log(const std::string& path);

// At most `max_bytes` of a file; "" when it cannot be read (or does not exist).
std::string read_small_file(const std::string& path, std::size_t max_bytes);

}  // namespace ddp::launcher
