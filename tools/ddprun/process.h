// The POSIX side of supervising workers: owned file descriptors, signals read from a signalfd,
// and worker processes started in, and stopped as, their own process groups.
//
// Everything here is for ddprun's single supervising thread (see Note [Supervision] in
// launcher.cpp). Failures of the system itself (no fds left, fork failing) throw ddp::Error
// with the call and errno's text.
#pragma once

#include <signal.h>        // sigset_t, sighandler_t
#include <sys/resource.h>  // rlimit
#include <sys/types.h>     // pid_t

#include <string>
#include <utility>  // std::exchange
#include <vector>

#include "ddp/error.h"  // ddp::Error, ddp::ConfigError

namespace ddp::launcher {

// PROGRAM could not be started at all: exit code 127 (not found) or 126 (found, not
// executable), as timeout(1), env(1) and shells do.
class ExecError : public ConfigError {
 public:
  ExecError(const std::string& message, int exit_code)
      : ConfigError(message), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// Throws ddp::Error "<what>: <strerror(errno)>".
[[noreturn]] void throw_errno(const std::string& what);

// An owned file descriptor; -1 when empty.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// --- Signals

// What ddprun forwards to its workers (and then dies of, see main.cpp).
inline constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// While it lives: SIGCHLD and kForwardedSignals are blocked and read from a signalfd (so that a
// signal between two checks is never lost), and SIGPIPE is ignored (a closed console makes
// writes fail with EPIPE instead of killing ddprun). Create it before the first fork.
class SignalChannel {
 public:
  SignalChannel();
  ~SignalChannel();
  SignalChannel(const SignalChannel&) = delete;
  SignalChannel& operator=(const SignalChannel&) = delete;

  int fd() const { return fd_.get(); }  // readable when a signal is pending
  // The mask ddprun started with: what a worker must run with.
  const sigset_t& original_mask() const { return original_mask_; }

  // The signals that arrived since the last call, in order.
  std::vector<int> read_pending();

 private:
  UniqueFd fd_;
  sigset_t original_mask_{};
  sighandler_t original_sigpipe_ = SIG_DFL;
};

// Makes ddprun the reaper of its workers' orphans while it lives (PR_SET_CHILD_SUBREAPER).
class SubreaperScope {
 public:
  SubreaperScope();
  ~SubreaperScope();
  SubreaperScope(const SubreaperScope&) = delete;
  SubreaperScope& operator=(const SubreaperScope&) = delete;
};

// --- Process setup

// Opens /dev/null on whichever of fds 0-2 is closed, so that a pipe cannot land there and be
// clobbered by a child's dup2.
void ensure_standard_fds();

// A worker group needs ~4 fds per worker: lifts the soft RLIMIT_NOFILE to the hard one and
// returns the original limit (what the workers get back).
rlimit raise_fd_limit();

// Where PROGRAM lives: itself if it has a '/', else the first executable match in `path_env`
// (a PATH value). Throws ExecError (127 not found, 126 not executable).
std::string resolve_program(const std::string& program, const std::string& path_env);

// --- Workers

// What one worker runs. Built whole before fork(): after it the child only makes system calls.
struct ExecImage {
  std::string path;               // resolved PROGRAM
  std::vector<std::string> argv;  // argv[0] as the user wrote it
  std::vector<std::string> envp;  // "KEY=value"
  std::string name;               // "rank 3", for ddprun's errors
  std::vector<int> cpus;          // its CPU affinity (--cpu-bind); empty: ddprun's own
};

// A started worker: its pid, which is also its process group's id, and the read ends
// (non-blocking, close-on-exec) of the pipes that are its stdout and stderr.
struct SpawnedWorker {
  pid_t pid = -1;
  UniqueFd out;
  UniqueFd err;
};

// Forks and execs `image` in a new process group, with stdin on /dev/null, the signal mask
// `child_mask`, RLIMIT_NOFILE `fd_limit`, and SIGKILL when ddprun dies (PR_SET_PDEATHSIG). An
// exec failure shows on the worker's stderr as "ddprun: cannot execute 'argv[0]': <reason>"
// and exits 127 (not found) or 126. Throws ddp::Error when it cannot fork or make pipes.
SpawnedWorker spawn_worker(const ExecImage& image, const sigset_t& child_mask,
                           const rlimit& fd_limit);

// Sends `signal` to process group `pgid` (0 only probes it). False when the group is empty, or
// when pgid <= 0 (a worker that never started: kill(-(-1)) would reach pid 1).
bool signal_process_group(pid_t pgid, int signal);

// True when process `pid` is stopped (/proc state T: SIGSTOP, SIGTSTP) or held by a tracer
// (t). Such a process acts on no signal but SIGKILL until it gets SIGCONT.
bool process_is_frozen(pid_t pid);

}  // namespace ddp::launcher
