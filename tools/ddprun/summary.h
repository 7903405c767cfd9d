// The failure summary: which worker caused a failed attempt, and how to say what happened to
// every worker. Pure functions of what the supervisor observed (no processes, no files), so each
// rule is unit-tested alone.
#pragma once

#include <sys/types.h>  // pid_t

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ddp::launcher {

// An error file's message is shown up to this many bytes, then " [...]".
inline constexpr std::size_t kMaxErrorMessageBytes = 4000;

// "SIGKILL" for 9; "signal 99" for what has no name.
std::string signal_name(int signal);

// "exit code 3", "SIGKILL (signal 9)" for a waitpid() status.
std::string describe_wait_status(int wait_status);

// "10s", "0.5s".
std::string format_seconds(double s);

// "0-2,5,7" for {0, 1, 2, 5, 7}.
std::string format_rank_list(const std::vector<int>& sorted_ranks);

// "2024-05-01T12:34:56" in local time, for microseconds since the Unix epoch.
std::string format_local_time(std::int64_t unix_us);

// What a TORCHELASTIC_ERROR_FILE says.
struct ErrorFileReport {
  // The message: the inner "message" of torchrun's {"message": {"message": "...", ...}} or the
  // string of {"message": "..."}; else (malformed JSON, another shape) the raw text. Trailing
  // whitespace removed, cut to max_bytes.
  std::string message;
  // When it was written, in microseconds since the Unix epoch: extraInfo.timestamp_us (ddp-cpp's
  // record_error), else extraInfo.timestamp x 10^6 (torchrun's, in seconds), else, for the
  // plain {"message": "..."}, a top-level "timestamp" in seconds. Each may be a string of
  // digits, as torchrun writes them, or a JSON integer. nullopt when none is there or valid.
  std::optional<std::int64_t> timestamp_us;
  // extraInfo.relayed_from (ddp-cpp's record_error of a Relayed error, ddp/relayed_error.h):
  // the rank whose failure this worker only reports. nullopt: the worker's own error.
  std::optional<int> relayed_from;
};
ErrorFileReport parse_error_file(const std::string& contents,
                                 std::size_t max_bytes = kMaxErrorMessageBytes);

// One worker at the end of an attempt, as the summary sees it.
struct WorkerEnd {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool reaped = true;             // false: still running, it could not be stopped
  int wait_status = 0;            // waitpid()'s, when reaped
  int signal_sent = 0;            // the last signal ddprun sent its process group; 0: none
  int reap_order = 0;             // 0 for the first worker ddprun reaped in the attempt, then 1...
  std::int64_t reaped_at_us = 0;  // when, in microseconds since the Unix epoch
  bool was_stopped = false;       // frozen (process state T: SIGSTOP, a debugger) when ddprun
                                  // stopped the group; ddprun sent SIGCONT after its signal
  std::optional<ErrorFileReport> error_file;  // nullopt: it wrote none (or an empty one)
  std::vector<std::string> stderr_tail;       // its last stderr lines, oldest first
};

// Note [Root cause]
// When one rank throws, its peers fail a moment later ("Connection closed by peer"), and the
// first failure ddprun *observes* (reaps) can be a peer's. So the root cause goes by the time
// each worker recorded its error, as torchrun does ("first error by timestamp"):
//
//   1. Who failed: every worker that exited non-zero or died of a signal, during the attempt or
//      its teardown, before or after ddprun's SIGTERM; except a worker that died of the very
//      signal ddprun sent it (SIGTERM, SIGKILL, a forwarded SIGINT) and wrote no error file:
//      that one was only stopped.
//   2. If any of them wrote an error file with a timestamp, the root cause is the earliest
//      timestamp (ties: the one reaped first). A relayed record (extraInfo.relayed_from = R:
//      "rank R failed and told me", ddp/relayed_error.h) counts as a record of rank R at that
//      time, since R failed before it said so: the announcing rank's own record often comes
//      later than its peers' relays, or never (ddprun's SIGTERM can end it first). So the root
//      cause is R even then, when R is a worker of this node; when R runs on another node, the
//      relaying worker stands in for it and the summary says whom it relays.
//   3. Otherwise it is the first failure ddprun reaped.
//
// The supervisor decides after the attempt is over: it has reaped every worker by then (at worst
// at the end of --grace-period), so error files written during the teardown are seen.
// The blind spot, shared with torchrun: a worker that dies without writing an error file
// (SIGSEGV, the OOM killer, _exit) loses to a peer whose error file says it lost that worker.
// Such a summary still shows the crash, under "Other workers".
bool failed(const WorkerEnd& worker);

struct RootCause {
  std::size_t index = 0;       // into the workers given to pick_root_cause()
  bool by_error_file = false;  // rule 2; false: rule 3
  // Rule 2 through a relayed record: the worker that wrote it (the root cause is the rank it
  // names, or, when that rank is on another node, this worker itself).
  std::optional<std::size_t> relayed_by;
  std::int64_t time_us = 0;  // rule 2: the record's timestamp
};
// The root cause among `workers` (see Note [Root cause]); nullopt when none failed.
std::optional<RootCause> pick_root_cause(const std::vector<WorkerEnd>& workers);

// How a worker that is not the root cause ended: "stopped by ddprun (SIGTERM)", "also failed
// (exit code 1)", "killed by ddprun (SIGKILL <kill_reason>)"... A worker that was frozen
// (was_stopped) is said to be so first: "was stopped (process state T: SIGSTOP or a debugger);
// ddprun resumed it: stopped by ddprun (SIGTERM)".
std::string describe_fate(const WorkerEnd& worker, const std::string& kill_reason);

// The report printed when an attempt failed:
//   ddprun: worker group failed (attempt 1 of 1)
//   Root cause (earliest error file):
//     time      : ...
//     rank      : 1 (local_rank 1) on host h
//     pid, exit, error file, last stderr lines
//   Other workers: rank 0 also failed (exit code 1); ranks 2-3 stopped by ddprun (SIGTERM)
//     error file of rank 0: RuntimeError: Connection closed by peer
//   Left early: rank 4 exited with code 0 before any worker failed, ... (when one did)
//   Earlier attempts:                                        (after restarts)
//     attempt 1: rank 1 (local_rank 1) killed by SIGKILL
// Without a root cause, only the first line and the earlier attempts.
struct SummaryContext {
  int attempt = 1;          // 1-based
  int attempts = 1;         // --max-restarts + 1
  std::string host;         // this node's name
  std::string kill_reason;  // "after the 10s grace period", when SIGKILL was sent
  // One line per earlier failed attempt that this ddprun ran, oldest first: "attempt 1: rank 1
  // (local_rank 1) exit code 1"; listed under "Earlier attempts:".
  std::vector<std::string> earlier_attempts;
};
std::string format_failure_summary(const SummaryContext& context,
                                   const std::vector<WorkerEnd>& workers,
                                   std::optional<RootCause> root_cause);

}  // namespace ddp::launcher
