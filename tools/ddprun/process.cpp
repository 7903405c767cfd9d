// ddprun's POSIX plumbing (see process.h).
#include "process.h"

#include <fcntl.h>         // open, fcntl, O_* flags
#include <sched.h>         // sched_setaffinity
#include <sys/prctl.h>     // PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER
#include <sys/signalfd.h>  // signalfd
#include <sys/stat.h>      // stat
#include <unistd.h>        // fork, execve, pipe2, dup2, access

#include <cerrno>
#include <csignal>
#include <cstring>  // strerror, strlen

#include <fmt/format.h>

#include "base/proc_stat.h"  // read_proc_stat: a stopped worker

namespace ddp::launcher {

void throw_errno(const std::string& what) {
  throw Error(fmt::format("{}: {}", what, std::strerror(errno)));
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

// ---------------------------------------------------------------------------------------------
// Signals

SignalChannel::SignalChannel() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  for (int s : kForwardedSignals) sigaddset(&set, s);
  if (::sigprocmask(SIG_BLOCK, &set, &original_mask_) != 0) throw_errno("sigprocmask");
  fd_.reset(::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC));
  if (fd_.get() < 0) {
    ::sigprocmask(SIG_SETMASK, &original_mask_, nullptr);
    throw_errno("signalfd");
  }
  original_sigpipe_ = ::signal(SIGPIPE, SIG_IGN);
}

SignalChannel::~SignalChannel() {
  fd_.reset();
  ::signal(SIGPIPE, original_sigpipe_);
  ::sigprocmask(SIG_SETMASK, &original_mask_, nullptr);
}

std::vector<int> SignalChannel::read_pending() {
  std::vector<int> signals;
  signalfd_siginfo info{};
  while (::read(fd_.get(), &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
    signals.push_back(static_cast<int>(info.ssi_signo));
  }
  return signals;
}

SubreaperScope::SubreaperScope() { ::prctl(PR_SET_CHILD_SUBREAPER, 1); }
SubreaperScope::~SubreaperScope() { ::prctl(PR_SET_CHILD_SUBREAPER, 0); }

// ---------------------------------------------------------------------------------------------
// Process setup

void ensure_standard_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      int opened = ::open("/dev/null", O_RDWR);  // takes the lowest free number: fd
      if (opened > 2) ::close(opened);
    }
  }
}

rlimit raise_fd_limit() {
  rlimit original{};
  ::getrlimit(RLIMIT_NOFILE, &original);
  rlimit raised = original;
  raised.rlim_cur = original.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &raised);
  return original;
}

std::string resolve_program(const std::string& program, const std::string& path_env) {
  auto check = [](const std::string& candidate) -> int {  // 0 ok, else errno
    struct stat st {};
    if (::stat(candidate.c_str(), &st) != 0) return errno;
    if (S_ISDIR(st.st_mode)) return EISDIR;
    return ::access(candidate.c_str(), X_OK) == 0 ? 0 : errno;
  };
  auto fail = [&](int err, const std::string& extra) -> std::string {
    throw ExecError(fmt::format("cannot execute '{}': {}{}", program, std::strerror(err), extra),
                    err == ENOENT || err == ENOTDIR ? 127 : 126);
  };
  if (program.empty()) fail(ENOENT, "");
  if (program.find('/') != std::string::npos) {
    int err = check(program);
    return err == 0 ? program : fail(err, "");
  }
  int first_error = ENOENT;
  std::size_t start = 0;
  while (start <= path_env.size()) {
    auto colon = path_env.find(':', start);
    std::string dir = path_env.substr(start, colon == std::string::npos ? colon : colon - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    int err = check(candidate);
    if (err == 0) return candidate;
    if (err != ENOENT && err != ENOTDIR && first_error == ENOENT) first_error = err;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return fail(first_error, first_error == ENOENT ? " (not found in PATH)" : "");
}

// ---------------------------------------------------------------------------------------------
// Workers

namespace {

// Null-terminated views of `strings`, for execve (which does not write through them).
std::vector<char*> c_array(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const std::string& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// The child's side of spawn_worker(): system calls only, then exec or _exit.
[[noreturn]] void exec_child(const char* path, char* const* argv, char* const* envp,
                             const std::string& failure_prefix, pid_t parent, int out_fd,
                             int err_fd, const sigset_t& mask, const rlimit& fd_limit,
                             const cpu_set_t* cpus) {
  ::setpgid(0, 0);  // own process group: a worker's children are stopped with it
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);  // ddprun died before the prctl took effect
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // the dup2 copy stays open
  if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(err_fd, STDERR_FILENO);
  ::signal(SIGPIPE, SIG_DFL);
  ::sigprocmask(SIG_SETMASK, &mask, nullptr);
  ::setrlimit(RLIMIT_NOFILE, &fd_limit);
  if (cpus != nullptr && ::sched_setaffinity(0, sizeof *cpus, cpus) != 0) {
    const char* why = std::strerror(errno);
    static constexpr char kWhat[] = "ddprun: cannot bind the worker to its CPUs (--cpu-bind): ";
    (void)!::write(STDERR_FILENO, kWhat, sizeof kWhat - 1);
    (void)!::write(STDERR_FILENO, why, std::strlen(why));
    (void)!::write(STDERR_FILENO, "\n", 1);
    ::_exit(126);
  }

  ::execve(path, argv, envp);

  int err = errno;
  const char* reason = std::strerror(err);
  (void)!::write(STDERR_FILENO, failure_prefix.data(), failure_prefix.size());
  (void)!::write(STDERR_FILENO, reason, std::strlen(reason));
  (void)!::write(STDERR_FILENO, "\n", 1);
  ::_exit(err == ENOENT ? 127 : 126);
}

}  // namespace

SpawnedWorker spawn_worker(const ExecImage& image, const sigset_t& child_mask,
                           const rlimit& fd_limit) {
  const std::vector<char*> argv = c_array(image.argv);
  const std::vector<char*> envp = c_array(image.envp);
  const std::string failure_prefix =
      fmt::format("ddprun: cannot execute '{}': ", image.argv.empty() ? image.path : image.argv[0]);

  int out[2];
  int err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw_errno("pipe");
  UniqueFd out_r(out[0]), out_w(out[1]);
  if (::pipe2(err, O_CLOEXEC) != 0) throw_errno("pipe");
  UniqueFd err_r(err[0]), err_w(err[1]);
  ::fcntl(out_r.get(), F_SETFL, O_NONBLOCK);
  ::fcntl(err_r.get(), F_SETFL, O_NONBLOCK);

  cpu_set_t cpus;  // made before fork: the child only calls async-signal-safe functions
  CPU_ZERO(&cpus);
  for (int id : image.cpus) {
    if (id >= 0 && id < CPU_SETSIZE) CPU_SET(id, &cpus);
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw_errno(fmt::format("cannot start {} (fork)", image.name));
  if (pid == 0) {
    exec_child(image.path.c_str(), argv.data(), envp.data(), failure_prefix, parent, out_w.get(),
               err_w.get(), child_mask, fd_limit, image.cpus.empty() ? nullptr : &cpus);
  }
  ::setpgid(pid, pid);  // also here, so a stop right after fork reaches the new group
  return SpawnedWorker{pid, std::move(out_r), std::move(err_r)};
}

bool signal_process_group(pid_t pgid, int signal) {
  if (pgid <= 0) return false;
  return ::kill(-pgid, signal) == 0 || errno == EPERM;
}

bool process_is_frozen(pid_t pid) {
  if (pid <= 0) return false;
  const std::optional<ProcStat> s = read_proc_stat(pid);  // nullopt: gone
  return s && s->stopped();
}

}  // namespace ddp::launcher
