// Test support: run a program as a child process with a deadline, and capture what it printed.
//
//   auto r = ddp::testing::run_command({.argv = {ddprun, "--nproc-per-node", "2", worker},
//                                       .env = {{"OMP_NUM_THREADS", "4"}},
//                                       .timeout_s = 30});
//   EXPECT_EQ(r.exit_code, 0) << r.describe();
//
// The child runs in its own process group with stdin on /dev/null; its stdout and stderr go to
// anonymous in-memory files (memfd), so it can never block on a full pipe and a test can read
// what it printed so far. At the deadline the whole process group gets SIGKILL and the result
// says timed_out: a hang becomes a failed assertion, not a stuck test run.
//
// Not thread-safe: one Subprocess is used from one thread. Header-only, POSIX/Linux.
#pragma once

#include <fcntl.h>     // open
#include <signal.h>    // kill
#include <sys/mman.h>  // memfd_create
#include <sys/wait.h>  // waitpid
#include <unistd.h>    // fork, execve, pread

#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace ddp::testing {

struct Command {
  std::vector<std::string> argv;           // argv[0] is a path (no PATH search)
  std::map<std::string, std::string> env;  // set on top of this process's environment
  std::vector<std::string> unset_env;      // removed from it (applied before `env`)
  double timeout_s = 60;                   // then SIGKILL to the child's process group
};

struct Result {
  int exit_code = -1;      // when the child exited; -1 otherwise
  int term_signal = 0;     // when a signal killed it; 0 otherwise
  bool timed_out = false;  // killed by us at the deadline
  std::string out;         // everything it wrote to stdout
  std::string err;         // ... and to stderr
  double wall_s = 0;       // from start to reaped

  bool exited(int code) const { return term_signal == 0 && exit_code == code; }
  // For assertion messages: how it ended, then its output.
  std::string describe() const {
    std::string how = timed_out          ? "TIMED OUT (killed at the deadline)"
                      : term_signal != 0 ? "killed by signal " + std::to_string(term_signal)
                                         : "exit code " + std::to_string(exit_code);
    return how + " after " + std::to_string(wall_s) + " s\n--- stdout ---\n" + out +
           "--- stderr ---\n" + err + "--- end ---";
  }
};

namespace detail {

inline int make_capture_file(const char* name) {
  int fd = ::memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) throw std::runtime_error(std::string("memfd_create: ") + std::strerror(errno));
  return fd;
}

inline std::string read_all(int fd) {
  std::string data;
  char buf[65536];
  off_t offset = 0;
  while (true) {
    ssize_t n = ::pread(fd, buf, sizeof buf, offset);
    if (n <= 0) return data;
    data.append(buf, static_cast<std::size_t>(n));
    offset += n;
  }
}

inline std::vector<std::string> child_environment(const Command& cmd) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const std::string& k : cmd.unset_env) env.erase(k);
  for (const auto& [k, v] : cmd.env) env[k] = v;
  std::vector<std::string> out;
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

}  // namespace detail

// A running child. Destroying it kills (SIGKILL, whole process group) and reaps it.
class Subprocess {
 public:
  // Starts `cmd`. Throws std::runtime_error when it cannot fork; an exec failure shows up as
  // exit code 127 with the reason on stderr.
  static Subprocess start(const Command& cmd) {
    if (cmd.argv.empty()) throw std::runtime_error("Subprocess: empty argv");
    Subprocess p;
    p.out_fd_ = detail::make_capture_file("stdout");
    p.err_fd_ = detail::make_capture_file("stderr");
    p.timeout_s_ = cmd.timeout_s;

    std::vector<std::string> args = cmd.argv;
    std::vector<std::string> env = detail::child_environment(cmd);
    std::vector<char*> argv_ptrs, env_ptrs;
    for (auto& a : args) argv_ptrs.push_back(a.data());
    argv_ptrs.push_back(nullptr);
    for (auto& e : env) env_ptrs.push_back(e.data());
    env_ptrs.push_back(nullptr);
    const std::string exec_failed = "Subprocess: cannot execute " + args[0] + ": ";

    p.started_ = std::chrono::steady_clock::now();
    p.pid_ = ::fork();
    if (p.pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (p.pid_ == 0) {
      ::setpgid(0, 0);
      int devnull = ::open("/dev/null", O_RDONLY);
      ::dup2(devnull, STDIN_FILENO);
      ::dup2(p.out_fd_, STDOUT_FILENO);
      ::dup2(p.err_fd_, STDERR_FILENO);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::execve(argv_ptrs[0], argv_ptrs.data(), env_ptrs.data());
      const char* why = std::strerror(errno);
      (void)!::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
      (void)!::write(STDERR_FILENO, why, std::strlen(why));
      ::_exit(127);
    }
    ::setpgid(p.pid_, p.pid_);
    return p;
  }

  Subprocess(Subprocess&& o) noexcept { *this = std::move(o); }
  Subprocess& operator=(Subprocess&& o) noexcept {
    std::swap(pid_, o.pid_);
    std::swap(out_fd_, o.out_fd_);
    std::swap(err_fd_, o.err_fd_);
    std::swap(started_, o.started_);
    std::swap(timeout_s_, o.timeout_s_);
    std::swap(result_, o.result_);
    std::swap(done_, o.done_);
    return *this;
  }
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess() {
    if (pid_ > 0 && !done_) {
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
    if (out_fd_ >= 0) ::close(out_fd_);
    if (err_fd_ >= 0) ::close(err_fd_);
  }

  pid_t pid() const { return pid_; }
  // Sends `sig` to the child only (not to its process group).
  void signal(int sig) const {
    if (pid_ > 0 && !done_) ::kill(pid_, sig);
  }
  std::string out_so_far() const { return detail::read_all(out_fd_); }
  std::string err_so_far() const { return detail::read_all(err_fd_); }
  double elapsed_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  }

  // Waits for the child to end, or for the deadline (timeout_s after start): then SIGKILLs its
  // process group. Returns the same result when called again.
  const Result& wait() {
    while (!done_) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        finish(status, false);
      } else if (r < 0 && errno != EINTR) {
        throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
      } else if (elapsed_s() > timeout_s_) {
        ::kill(-pid_, SIGKILL);
        ::kill(pid_, SIGKILL);
        while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
        }
        finish(status, true);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
    return result_;
  }

 private:
  Subprocess() = default;

  void finish(int status, bool timed_out) {
    done_ = true;
    result_.wall_s = elapsed_s();
    result_.timed_out = timed_out;
    if (WIFEXITED(status)) result_.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) result_.term_signal = WTERMSIG(status);
    result_.out = detail::read_all(out_fd_);
    result_.err = detail::read_all(err_fd_);
  }

  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  std::chrono::steady_clock::time_point started_;
  double timeout_s_ = 60;
  Result result_;
  bool done_ = false;
};

// A variable ctest sets for the test (a binary's path); throws when run outside ctest.
inline std::string env_or_die(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) throw std::runtime_error(std::string(name) + " is not set (run via ctest)");
  return v;
}

// Runs `cmd` to completion (or its deadline).
inline Result run_command(const Command& cmd) { return Subprocess::start(cmd).wait(); }

// Polls `condition` every few milliseconds for up to `timeout_s`; returns its last value.
inline bool wait_until(const std::function<bool()>& condition, double timeout_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace ddp::testing
