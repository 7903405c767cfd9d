// One attempt of the worker group (see worker_group.h and Note [Supervision] in launcher.cpp).
#include "worker_group.h"

#include <poll.h>      // poll
#include <sys/wait.h>  // waitpid, W* macros
#include <unistd.h>    // STDOUT_FILENO

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdint>

#include <fmt/format.h>

#include "output.h"   // Stream, note
#include "summary.h"  // pick_root_cause, format_failure_summary

namespace ddp::launcher {
namespace {

using SteadyClock = std::chrono::steady_clock;
using WallClock = std::chrono::system_clock;

// An error file is read up to this size. Its message is cut much shorter for the summary, but
// the JSON must be whole to be parsed, and a Python traceback (py_callstack) can be long.
constexpr std::size_t kMaxErrorFileBytes = 1024 * 1024;

double seconds_between(SteadyClock::time_point a, SteadyClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::int64_t unix_us(WallClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

}  // namespace

struct Worker {
  Worker(int local_rank_in, int rank_in, Stream out_in, Stream err_in)
      : local_rank(local_rank_in), rank(rank_in), out(std::move(out_in)), err(std::move(err_in)) {}

  const int local_rank;
  const int rank;
  std::string error_file;  // TORCHELASTIC_ERROR_FILE
  Stream out;
  Stream err;
  pid_t pid = -1;  // also the id of its process group
  bool running = false;
  int signal_sent = 0;       // the last signal ddprun sent its process group; 0: none
  bool was_stopped = false;  // frozen (state T) when ddprun signalled it

  // Valid once reaped (!running).
  int wait_status = 0;
  int reap_order = -1;  // 0: the first worker reaped in this attempt
  WallClock::time_point reaped_at;

  bool succeeded() const { return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0; }
  // Sends `signal` to the worker's whole process group. False when the group is empty.
  bool signal_group(int signal) const { return signal_process_group(pid, signal); }
};

WorkerGroup::WorkerGroup(SharedState& shared, Rounds& rounds, GroupSpec group)
    : s_(shared), rounds_(rounds), group_(std::move(group)) {}

WorkerGroup::~WorkerGroup() { kill_and_reap_everything(); }

Outcome WorkerGroup::run() {
  start_all();
  while (!finished()) {
    wait_for_events();
    handle_signals();
    reap();
    advance();
    watch_other_nodes();
  }
  for (auto& w : workers_) {
    w->out.drain();
    w->err.drain();
  }
  collect_ends();
  if (first_failure_ != nullptr) root_cause_ = pick_root_cause(ends_);
  if (interrupt_signal_ != 0) return Outcome::kInterrupted;
  if (!regroup_.empty() && first_failure_ == nullptr && failure_elsewhere_.empty()) {
    // Workers that all finished meanwhile finished the job.
    const bool done = std::ranges::all_of(workers_, [](const auto& w) { return w->succeeded(); });
    return done ? Outcome::kSucceeded : Outcome::kRegroup;
  }
  return first_failure_ != nullptr || !failure_elsewhere_.empty() ? Outcome::kFailed
                                                                  : Outcome::kSucceeded;
}

void WorkerGroup::start_all() {
  const LaunchConfig& c = s_.config;
  for (int lr = 0; lr < c.nproc_per_node; ++lr) {
    std::string dir = s_.run_dir.rank_dir(group_.restart_count, lr);
    int rank = group_.node_rank * c.nproc_per_node + lr;
    std::string prefix = fmt::format("[rank {}]: ", rank);
    auto stream = [&](Std which, int console_fd, const char* file, std::size_t tail) {
      UniqueFd log;
      if (c.writes_to_file(lr, which)) log = open_log(dir + "/" + file);
      return Stream(prefix, c.shows_on_console(lr, which) ? console_fd : -1, std::move(log), tail);
    };
    auto w =
        std::make_unique<Worker>(lr, rank, stream(Std::kOut, STDOUT_FILENO, "stdout.log", 0),
                                 stream(Std::kErr, STDERR_FILENO, "stderr.log", kStderrTailLines));
    w->error_file = dir + "/error.json";
    workers_.push_back(std::move(w));
    start(*workers_.back());
  }
}

void WorkerGroup::start(Worker& w) {
  ExecImage image;
  image.path = s_.program_path;
  image.argv = s_.config.worker_argv;
  EnvMap env = worker_environment(s_.config, group_, w.local_rank, w.error_file, s_.base_env);
  if (!s_.binding.workers.empty()) {  // Note [CPU binding] in cpu_bind.h
    const Binding& b = s_.binding.workers.at(static_cast<size_t>(w.local_rank));
    image.cpus = b.cpus;
    if (!s_.base_env.contains("OMP_NUM_THREADS")) env["OMP_NUM_THREADS"] = std::to_string(b.threads);
  }
  // What the worker's ddp::ensure_fast_blas would re-execute it to set, set from its start.
  env.merge(fast_blas_environment(s_.blas, env));
  for (const auto& [k, v] : env) image.envp.push_back(k + "=" + v);
  image.name = fmt::format("rank {}", w.rank);
  SpawnedWorker spawned = spawn_worker(image, s_.signals.original_mask(), s_.fd_limit);
  w.pid = spawned.pid;
  w.running = true;
  w.out.attach(std::move(spawned.out));
  w.err.attach(std::move(spawned.err));
}

void WorkerGroup::wait_for_events() {
  double timeout_s = s_.config.monitor_interval.count();
  if (stopping_ && !killed_) {
    timeout_s = std::min(timeout_s, seconds_between(SteadyClock::now(), kill_deadline_));
  }
  int timeout_ms = std::max(1, static_cast<int>(timeout_s * 1000.0 + 0.999));

  std::vector<pollfd> fds{{s_.signals.fd(), POLLIN, 0}};
  std::vector<Stream*> streams;
  for (auto& w : workers_) {
    for (Stream* st : {&w->out, &w->err}) {
      if (st->fd() < 0) continue;
      fds.push_back({st->fd(), POLLIN, 0});
      streams.push_back(st);
    }
  }
  if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) throw_errno("poll");
  for (std::size_t i = 0; i < streams.size(); ++i) {
    if (fds[i + 1].revents != 0) streams[i]->pump();
  }
}

void WorkerGroup::handle_signals() {
  for (int sig : s_.signals.read_pending()) {
    if (sig == SIGCHLD) continue;  // reap() runs next anyway
    if (interrupt_signal_ == 0 && !stopping_) {
      interrupt_signal_ = sig;
      // Elastic: the others go on without this node (a spot reclaim's notice). Written before
      // the workers get the signal, so that no node takes their exit for a failure.
      leaving_ = rounds_.announce_leaving(group_.restart_count,
                                          fmt::format("its ddprun received {}", signal_name(sig)));
      note(fmt::format("received {}; forwarding it to the workers (SIGKILL in {}){}",
                       signal_name(sig), format_seconds(s_.config.grace_period.count()),
                       leaving_ ? "; this node leaves the elastic job, the others go on" : ""));
      stop_all(sig);
    } else if (!killed_) {
      if (interrupt_signal_ == 0) interrupt_signal_ = sig;
      note(fmt::format("received {} while stopping the workers; sending SIGKILL now",
                       signal_name(sig)));
      kill_all(fmt::format("after ddprun received {} while stopping", signal_name(sig)));
    }
  }
}

void WorkerGroup::reap() {
  while (true) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;  // 0: nothing exited; -1/ECHILD: no children left
    for (auto& w : workers_) {
      if (w->pid == pid && w->running) on_exit(*w, status);
    }
    // Any other pid is an orphan of a worker, adopted by ddprun the subreaper: reaped, done.
  }
}

void WorkerGroup::on_exit(Worker& w, int status) {
  w.running = false;
  w.wait_status = status;
  w.reap_order = reaped_count_++;
  w.reaped_at = WallClock::now();
  if (!w.succeeded() && !stopping_ && first_failure_ == nullptr) first_failure_ = &w;
  // advance() stops the others, after this round of reaping: a worker that died at the same
  // moment is then reported as having failed too, not as stopped by ddprun.
}

// Decisions after each round of reaping: stop the group after a failure, stop leftovers after a
// clean exit, SIGKILL at the end of the grace period.
void WorkerGroup::advance() {
  if (s_.config.ft && !stopping_) restart_failed_alone();
  if (!stopping_ && first_failure_ != nullptr && regroup_now("a worker exited")) {
    first_failure_ = nullptr;  // stopped for the re-forming (another node signalled first)
  }
  if (!stopping_ && first_failure_ != nullptr) {
    Worker& w = *first_failure_;
    w.out.pump();  // its last words first, then ours
    w.err.pump();
    // The other nodes learn it now, not from a collective timeout (Note [Restart rounds]).
    const std::string what =
        fmt::format("rank {} failed ({})", w.rank, describe_wait_status(w.wait_status));
    // Final too when --ft's restarts are spent: a job restarted whole under --ft would find its
    // quorums' records newer than every replica's state, and refuse to train.
    const bool final = ft_restarts_spent_ ||
                       (WIFEXITED(w.wait_status) && WEXITSTATUS(w.wait_status) == kUsageExitCode);
    if (auto first = rounds_.report_failure(group_.restart_count, what, final)) {
      failure_elsewhere_ = *first;
    } else if (final && final_failure_.empty()) {  // --ft's spent restarts said theirs
      final_failure_ = what;
    }
    auto running = std::ranges::count_if(workers_, [](const auto& o) { return o->running; });
    note(
        fmt::format("rank {} failed ({}); stopping the other {} running worker(s): SIGTERM, then "
                    "SIGKILL after {}",
                    w.rank, describe_wait_status(w.wait_status), running,
                    format_seconds(s_.config.grace_period.count())));
    stop_all(SIGTERM);
  }
  if (!stopping_ && all_reaped() && any_group_alive()) {
    note("the workers exited but left processes in their process groups; stopping them");
    stop_all(SIGTERM);
  }
  if (stopping_ && !killed_ && SteadyClock::now() >= kill_deadline_) {
    kill_all(
        fmt::format("after the {} grace period", format_seconds(s_.config.grace_period.count())));
  }
  if (killed_) {
    for (auto& w : workers_) w->signal_group(SIGKILL);  // stragglers forked during the stop
  }
}

// --ft: a worker that failed is started again alone while the others go on; they re-form
// without it and heal it when it is back (Note [Per-step fault tolerance] in
// ddp/fault_tolerance.h). --max-restarts bounds them all together; past it the failure is final
// and stops the group.
void WorkerGroup::restart_failed_alone() {
  for (auto& w : workers_) {
    if (w->running || w->succeeded()) continue;
    const std::string what =
        fmt::format("rank {} failed ({})", w->rank, describe_wait_status(w->wait_status));
    if (ft_restarts_ >= s_.config.max_restarts) {
      // Final: the whole group is not started again either (the budget was the same).
      final_failure_ = fmt::format("{}, with --ft's {} restart(s) spent", what, ft_restarts_);
      ft_restarts_spent_ = true;
      note(fmt::format("{}; --ft's {} restart(s) (--max-restarts) are spent: the job fails", what,
                       ft_restarts_));
      if (first_failure_ == nullptr) first_failure_ = w.get();
      return;
    }
    w->out.drain();  // its last words first, then ours
    w->err.drain();
    ++ft_restarts_;
    note(fmt::format("{}; starting it again alone, the others go on (--ft: restart {} of {})", what,
                     ft_restarts_, s_.config.max_restarts));
    if (first_failure_ == w.get()) first_failure_ = nullptr;
    start(*w);
  }
}

// Another node's workers failed in this round: this node's stop too, and the round restarts
// everywhere (Note [Restart rounds]).
void WorkerGroup::watch_other_nodes() {
  // Polled while stopping too: the poll is also this node's sign of life (Note [Restart rounds]).
  std::optional<std::string> elsewhere = rounds_.failure_elsewhere(group_.restart_count);
  if (!stopping_ && !elsewhere) {
    regroup_now(nullptr);
    return;
  }
  if (stopping_ || !elsewhere) return;
  failure_elsewhere_ = *elsewhere;
  auto running = std::ranges::count_if(workers_, [](const auto& o) { return o->running; });
  note(
      fmt::format("another node failed ({}); stopping this node's {} running worker(s): "
                  "SIGTERM, then SIGKILL after {}",
                  failure_elsewhere_, running, format_seconds(s_.config.grace_period.count())));
  stop_all(SIGTERM);
}

// Elastic: when the job re-forms (Note [Elastic rounds] in elastic.h), stops this node's
// workers as a preemption does (SIGTERM: ddp-train checkpoints with every rank and exits), then
// SIGKILL after the grace period. `what`: a worker's exit made us ask now; null: the poll.
bool WorkerGroup::regroup_now(const char* what) {
  std::optional<std::string> why = rounds_.regroup(group_.restart_count, what != nullptr);
  if (!why) return false;
  regroup_ = *why;
  auto running = std::ranges::count_if(workers_, [](const auto& o) { return o->running; });
  note(fmt::format("the elastic job re-forms ({}); stopping this node's {} running worker(s) as "
                   "for a preemption: SIGTERM, then SIGKILL after {}",
                   regroup_, running, format_seconds(s_.config.grace_period.count())));
  stop_all(SIGTERM);
  return true;
}

// Done when every worker is reaped and its process group is empty. Processes that outlive
// SIGKILL by kKillWait (stuck in the kernel) are waited for if they are workers, and given up on
// with a note if they are the workers' leftovers.
bool WorkerGroup::finished() {
  const bool reaped = all_reaped();
  if (reaped && !any_group_alive()) return true;
  if (!killed_ || seconds_between(killed_at_, SteadyClock::now()) < kKillWait.count()) return false;
  if (!reaped) {
    if (!warned_stuck_) note("some workers are still alive after SIGKILL; waiting for them");
    warned_stuck_ = true;
    return false;
  }
  note(
      fmt::format("processes left in the workers' process groups survived SIGKILL for {}; "
                  "leaving them",
                  format_seconds(kKillWait.count())));
  return true;
}

// Note [Stopped workers]
// A frozen process (SIGSTOP, SIGTSTP, a debugger) acts on no signal but SIGKILL: a SIGTERM
// waits, pending, until it is continued, so the group's teardown would sit out the whole grace
// period. Every signal that stops the group is therefore followed by SIGCONT to the same
// process group: a frozen worker wakes up to the pending SIGTERM and exits like the others (a
// running one ignores SIGCONT). A worker found frozen at that moment is marked, and the summary
// says so: often it is why its peers failed ("rank 1 is stopped" in their errors).
void WorkerGroup::signal_all(int signal) {
  for (auto& w : workers_) {
    if (w->running) {
      w->signal_sent = signal;
      if (process_is_frozen(w->pid)) w->was_stopped = true;
    }
    if (w->signal_group(signal) && signal != SIGKILL) w->signal_group(SIGCONT);
  }
}

void WorkerGroup::stop_all(int signal) {
  signal_all(signal);
  if (!stopping_) {
    stopping_ = true;
    kill_deadline_ = SteadyClock::now() +
                     std::chrono::duration_cast<SteadyClock::duration>(s_.config.grace_period);
  }
}

void WorkerGroup::kill_all(const std::string& why) {
  signal_all(SIGKILL);
  if (!killed_) {
    killed_ = true;
    killed_at_ = SteadyClock::now();
    kill_reason_ = why;
  }
  stopping_ = true;
}

bool WorkerGroup::any_group_alive() const {
  return std::ranges::any_of(workers_, [](const auto& w) { return w->signal_group(0); });
}

bool WorkerGroup::all_reaped() const {
  return std::ranges::none_of(workers_, [](const auto& w) { return w->running; });
}

// What the summary needs of each worker, error files included: read now that every worker is
// reaped, so that those written during the teardown count too (Note [Root cause]).
void WorkerGroup::collect_ends() {
  ends_.clear();
  for (const auto& w : workers_) {
    WorkerEnd e;
    e.rank = w->rank;
    e.local_rank = w->local_rank;
    e.pid = w->pid;
    e.reaped = !w->running;
    e.wait_status = w->wait_status;
    e.signal_sent = w->signal_sent;
    e.was_stopped = w->was_stopped;
    e.reap_order = w->reap_order;
    e.reaped_at_us = unix_us(w->reaped_at);
    const std::string text = read_small_file(w->error_file, kMaxErrorFileBytes);
    if (!text.empty()) e.error_file = parse_error_file(text);
    e.stderr_tail.assign(w->err.tail().begin(), w->err.tail().end());
    ends_.push_back(std::move(e));
  }
}

void WorkerGroup::kill_and_reap_everything() {
  for (auto& w : workers_) {
    w->signal_group(SIGKILL);
    if (w->running) {
      int status = 0;
      while (::waitpid(w->pid, &status, 0) < 0 && errno == EINTR) {
      }
      w->running = false;
    }
  }
  while (::waitpid(-1, nullptr, WNOHANG) > 0) {
  }
}

std::string WorkerGroup::one_line_failure() const {
  if (!failure_elsewhere_.empty()) return "another node failed first: " + failure_elsewhere_;
  if (!root_cause_) return "no root cause recorded";
  const WorkerEnd& w = ends_[root_cause_->index];
  return fmt::format("rank {} (local_rank {}) {}", w.rank, w.local_rank,
                     describe_wait_status(w.wait_status));
}

std::string WorkerGroup::summary(int attempt, int attempts,
                                 const std::vector<std::string>& earlier) const {
  SummaryContext context{attempt, attempts, s_.host, kill_reason_, earlier};
  std::string out = format_failure_summary(context, ends_, root_cause_);
  if (!failure_elsewhere_.empty()) {
    out += fmt::format("The job's first failure was on another node: {}\n", failure_elsewhere_);
  }
  return out;
}

}  // namespace ddp::launcher
