// ddprun's supervisor (see launcher.h).
//
// Note [Supervision]
// One thread does everything, in one loop per attempt of the worker group:
//
//   1. Start. For each local rank: two pipes (stdout, stderr), then fork. The child puts itself
//      in its own process group (so that stopping a worker stops its children too), asks for
//      SIGKILL when ddprun dies (PR_SET_PDEATHSIG, then re-checks getppid() in case ddprun died
//      before the prctl), restores the signal mask, points fds 0/1/2 at /dev/null and the pipes,
//      and execs. An exec failure exits 127/126 with "ddprun: cannot execute ...".
//      (spawn_worker() in process.cpp.)
//   2. Watch. poll() on a signalfd (SIGCHLD and the forwarded signals, blocked since before the
//      first fork, so none is lost) and on every pipe, waking at least every --monitor-interval.
//      Output is cut into lines, prefixed "[rank N]: " and written whole (a partial line waits
//      for its end, or for the worker's exit); log files get the raw bytes. (Stream, output.h.)
//   3. Reap. waitpid(-1, WNOHANG) until nothing is left to collect. ddprun is a child subreaper,
//      so a worker's orphaned children come back to it and are reaped here too.
//   4. Stop. The first worker to exit non-zero or die of a signal fails the attempt: every
//      worker's process group gets SIGTERM, and SIGKILL once --grace-period has passed. A
//      forwarded signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) stops the group the same way with that
//      signal; a second one sends SIGKILL at once. Each such signal is followed by SIGCONT
//      (Note [Stopped workers]). When every worker has exited 0, process
//      groups that still hold something (a worker's leftover child) are stopped the same way.
//      Workers that exit while the group is being stopped are reaped and recorded like any other.
//   5. End. The attempt is over when every worker is reaped and every worker's process group is
//      empty. The pipes are drained and partial last lines flushed. If the attempt failed, the
//      root cause is chosen now, from every worker's end and error file (Note [Root cause] in
//      summary.h): it need not be the failure that started the stop.
//
// Then run() either returns (success, or ddprun was signalled), starts the next attempt
// (--max-restarts; TORCHELASTIC_RESTART_COUNT + 1), or prints the root-cause summary.
// No process outlives run(): WorkerGroup's destructor SIGKILLs and reaps whatever is left if an
// exception cuts the loop short.
//
// Note [Final failures]
// A worker that exits with code 2 (kUsageExitCode: a usage or configuration error, as
// argparse, ddp-train and ddprun itself use it: a bad flag, a resume refused because every
// checkpoint is corrupt) would fail the same way after a restart. When the attempt's first
// failure is such an exit, ddprun does not restart, whatever --max-restarts allows, and says
// why; with several nodes the failure is reported final to every node (Note [Restart rounds]),
// so none of them restarts either. Any other exit code or signal is restarted.
#include "launcher.h"

#include <poll.h>        // poll
#include <sys/random.h>  // getrandom: the job's store secret
#include <sys/wait.h>    // waitpid, W* macros
#include <unistd.h>      // access

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>  // strerror
#include <memory>
#include <optional>
#include <random>  // std::random_device for run ids
#include <vector>

#include <fmt/format.h>

#include "args.h"      // GroupSpec, worker_environment, UsageError
#include "base/net.h"  // pick_free_port, host_name, unresolvable
#include "ddp/env.h"   // current_environment
#include "elastic.h"   // make_elastic_rounds: every multi-node job's rounds
#include "output.h"    // Stream, RunDirectory, note
#include "rounds.h"    // Rounds: restarting several nodes together
#include "summary.h"   // WorkerEnd, pick_root_cause, format_failure_summary

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

// A UUID4-shaped id, like torchrun's --standalone run ids.
std::string random_run_id() {
  std::random_device rd;
  std::string hex;
  for (int i = 0; i < 4; ++i) hex += fmt::format("{:08x}", rd());
  hex[12] = '4';
  return fmt::format("{}-{}-{}-{}-{}", hex.substr(0, 8), hex.substr(8, 4), hex.substr(12, 4),
                     hex.substr(16, 4), hex.substr(20, 12));
}

// Note [Job secret]
// The rendezvous store admits only processes that prove they hold the job's key (Note [Store
// protocol] in src/store/protocol.h), DDP_STORE_SECRET when the workers have one. ddprun hands
// its workers the DDP_STORE_SECRET it inherited (a multi-node job exports the same one on every
// node); without one, when it launches the whole job (a single node) it makes a fresh random
// secret that only its workers see (a process's environment is readable by its own user and
// root only). Several nodes without one cannot agree on a secret without a channel: the store
// then keys on the run id, which keeps other jobs out but not a stranger who learns the id,
// and rank 0 says so when its store listens beyond loopback.
std::string job_secret(const LaunchConfig& config, const EnvMap& base) {
  if (auto it = base.find("DDP_STORE_SECRET"); it != base.end() && !it->second.empty()) {
    return it->second;
  }
  if (config.nnodes > 1) return "";
  unsigned char raw[32];
  std::size_t done = 0;
  while (done < sizeof raw) {
    const ssize_t n = ::getrandom(raw + done, sizeof raw - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw_errno("getrandom (the job's store secret)");
    done += static_cast<std::size_t>(n);
  }
  std::string hex;
  for (unsigned char c : raw) hex += fmt::format("{:02x}", c);
  return hex;
}

// ---------------------------------------------------------------------------------------------
// One attempt of the worker group.

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

// kRegroup: an elastic job re-forms (a node left or waits to be admitted); not a failure.
enum class Outcome { kSucceeded, kFailed, kInterrupted, kRegroup };

// What every attempt shares; constant for the whole run.
struct SharedState {
  const LaunchConfig& config;
  SignalChannel& signals;
  const RunDirectory& run_dir;
  const EnvMap& base_env;
  const std::string& program_path;
  const rlimit& fd_limit;
  std::string host;
  BindingPlan binding;  // each local worker's CPUs (--cpu-bind); empty: none
};

class WorkerGroup {
 public:
  WorkerGroup(SharedState& shared, Rounds& rounds, GroupSpec group)
      : s_(shared), rounds_(rounds), group_(std::move(group)) {}
  ~WorkerGroup() { kill_and_reap_everything(); }
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  Outcome run();

  // After run():
  int interrupt_signal() const { return interrupt_signal_; }
  bool has_root_cause() const { return root_cause_.has_value(); }
  // The round's first failure, when it was another node's (Note [Restart rounds]).
  const std::string& failure_elsewhere() const { return failure_elsewhere_; }
  // The first failure was this node's and final (Note [Final failures]): its description.
  const std::string& final_failure() const { return final_failure_; }
  // Why the elastic job re-forms (Outcome::kRegroup; Note [Elastic rounds] in elastic.h).
  const std::string& regroup() const { return regroup_; }
  // This node announced that it leaves the elastic job (its ddprun got a signal).
  bool leaving() const { return leaving_; }
  std::string one_line_failure() const;
  std::string summary(int attempt, int attempts, const std::vector<std::string>& earlier) const;

 private:
  void start_all();
  void start(Worker& w);
  void wait_for_events();
  void handle_signals();
  void reap();
  void on_exit(Worker& w, int status);
  void advance();
  void watch_other_nodes();
  bool regroup_now(const char* what);
  bool finished();
  void signal_all(int signal);
  void stop_all(int signal);
  void kill_all(const std::string& why);
  bool any_group_alive() const;
  bool all_reaped() const;
  void collect_ends();
  void kill_and_reap_everything();

  // Constant after construction.
  SharedState& s_;
  Rounds& rounds_;
  const GroupSpec group_;

  std::vector<std::unique_ptr<Worker>> workers_;
  int reaped_count_ = 0;

  // Stopping state: set once, by the first failure or signal.
  bool stopping_ = false;
  SteadyClock::time_point kill_deadline_;
  bool killed_ = false;
  std::string kill_reason_;  // "after the 10s grace period"
  SteadyClock::time_point killed_at_;
  Worker* first_failure_ = nullptr;  // the failure that stopped the group; not the root cause
  int interrupt_signal_ = 0;         // first forwarded signal received
  bool warned_stuck_ = false;
  std::string failure_elsewhere_;  // another node failed first: its line from the agent store
  std::string final_failure_;      // see final_failure()
  std::string regroup_;            // see regroup()
  bool leaving_ = false;           // see leaving()

  // Set at the end of run().
  std::vector<WorkerEnd> ends_;          // one per worker, in local rank order
  std::optional<RootCause> root_cause_;  // into ends_; set when the attempt failed
};

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
    const bool final = WIFEXITED(w.wait_status) && WEXITSTATUS(w.wait_status) == kUsageExitCode;
    if (auto first = rounds_.report_failure(group_.restart_count, what, final)) {
      failure_elsewhere_ = *first;
    } else if (final) {
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

// ---------------------------------------------------------------------------------------------

void print_startup_notes(const LaunchConfig& config, const EnvMap& base, const RunDirectory& dir,
                         const BindingPlan& binding) {
  if (!binding.note.empty()) {
    note(binding.note + (base.contains("OMP_NUM_THREADS")
                             ? "; OMP_NUM_THREADS as exported"
                             : "; OMP_NUM_THREADS = the worker's CPUs"));
  } else if (sets_omp_num_threads(config, base)) {
    note(
        fmt::format("setting OMP_NUM_THREADS=1 for each of the {} workers on this node so they do "
                    "not oversubscribe the CPUs; export OMP_NUM_THREADS=<n> to choose another "
                    "value",
                    config.nproc_per_node));
  }
  if (config.any_log_files()) {
    note(fmt::format("worker logs: {}/attempt_<k>/<local_rank>/{{stdout,stderr}}.log", dir.path()));
  }
}

GroupSpec group_for_round(const LaunchConfig& config, const std::string& run_id,
                          const std::string& secret, const Membership& m, bool agent_store) {
  const int round = m.round;
  GroupSpec g;
  g.node_rank = m.node_rank;
  g.nnodes = m.nnodes;
  g.store_secret = secret;
  g.master_addr = m.store_addr.empty() ? config.master_addr : m.store_addr;
  g.master_port = config.pick_free_port ? net::pick_free_port()
                  : m.store_addr.empty() ? config.master_port
                                         : m.store_port;
  g.run_id = run_id;
  g.restart_count = round;
  // Python workers (a .py, -m, or a Python interpreter as PROGRAM) reach a store with a
  // TCPStore client, which cannot talk to ours: their rank 0 hosts one (PyTorch's env://) on
  // the next port (Note [Restart rounds]).
  g.agent_store = agent_store && !config.python_worker;
  if (agent_store && config.python_worker) g.master_port += 1;
  return g;
}

// PROGRAM as the workers will run it: its path, refused now when it cannot run.
std::string program_to_run(const LaunchConfig& config, const EnvMap& base_env) {
  auto path_it = base_env.find("PATH");
  std::string path =
      resolve_program(config.worker_argv.at(0),
                      path_it != base_env.end() ? path_it->second : "/usr/local/bin:/usr/bin:/bin");
  if (config.via_python && !config.module && ::access(config.program.c_str(), R_OK) != 0) {
    throw ExecError(fmt::format("cannot run '{}' with {}: {}", config.program, kPythonInterpreter,
                                std::strerror(errno)),
                    127);
  }
  if (!config.master_addr_source.empty()) {  // Note [ddprun under srun] in args.cpp
    if (std::optional<std::string> why = net::unresolvable(config.master_addr)) {
      throw UsageError(fmt::format(
          "the store's host '{}', {}, does not resolve on this node ({}): pass --master-addr "
          "<the address of node 0> (or --rdzv-endpoint), or make the node names resolve here",
          config.master_addr, config.master_addr_source, *why));
    }
  }
  return path;
}

// Attempt after attempt of the worker group, each in the round every node joins (Note [Restart
// rounds]), until one decides how the run ends.
class RoundLoop {
 public:
  RoundLoop(SharedState& shared, Rounds& rounds, const std::string& run_id,
            const std::string& secret)
      : s_(shared), rounds_(rounds), run_id_(run_id), secret_(secret),
        attempts_(shared.config.max_restarts + 1) {}

  RunResult run();

 private:
  // Whether ddprun received a signal that ends its waits.
  bool signalled();
  // The next round this node runs in; a result instead when the run ends before it.
  std::optional<RunResult> join(int next, std::optional<Membership>& m);
  // What an attempt's outcome means: nullopt to run the next round, else the run's result.
  std::optional<RunResult> after(const WorkerGroup& group, Outcome outcome, const Membership& m);
  RunResult end_run(const WorkerGroup& group, Outcome outcome, const Membership& m);

  // Constant after construction.
  SharedState& s_;
  Rounds& rounds_;
  const std::string& run_id_;
  const std::string& secret_;
  const int attempts_;

  int stop_signal_ = 0;
  std::vector<std::string> earlier_;  // each failed attempt's root cause, for the last summary
};

RunResult RoundLoop::run() {
  int next = 0;
  while (true) {
    std::optional<Membership> m;
    if (std::optional<RunResult> ended = join(next, m)) return *ended;
    WorkerGroup group(s_, rounds_,
                      group_for_round(s_.config, run_id_, secret_, *m, rounds_.agent_store()));
    const Outcome outcome = group.run();
    if (std::optional<RunResult> done = after(group, outcome, *m)) return *done;
    next = m->round + 1;
  }
}

bool RoundLoop::signalled() {
  for (int sig : s_.signals.read_pending()) {
    if (sig != SIGCHLD && stop_signal_ == 0) stop_signal_ = sig;
  }
  return stop_signal_ != 0;
}

std::optional<RunResult> RoundLoop::join(int next, std::optional<Membership>& m) {
  try {
    m = rounds_.join(next, [this] { return signalled(); });
  } catch (const JobEnded& e) {  // elastic: the job ended while this node waited to join
    note(e.what());
    return RunResult{e.succeeded ? 0 : 1, 0};
  } catch (const Error&) {  // no next round (main() prints why): what the attempts ended with
    if (!earlier_.empty()) {
      std::string lines = "ddprun: the job's attempts so far:\n";
      for (const std::string& line : earlier_) lines += "  " + line + "\n";
      write_all(STDERR_FILENO, lines);
    }
    throw;
  }
  if (m) return std::nullopt;
  note(fmt::format("stopped by {} while waiting for the other nodes", signal_name(stop_signal_)));
  return RunResult{128 + stop_signal_, stop_signal_};
}

std::optional<RunResult> RoundLoop::after(const WorkerGroup& group, Outcome outcome,
                                          const Membership& m) {
  // Restarts used (elastic: failures only); what --max-restarts allows is checked against it.
  const int used = m.restarts;
  if (outcome == Outcome::kSucceeded) {
    rounds_.leave(m.round, false, [this] { return signalled(); });
    return RunResult{0, 0};
  }
  if (outcome == Outcome::kRegroup) {
    note(fmt::format("re-forming the elastic job after round {} ({}); not counted as a restart",
                     m.round, group.regroup()));
    return std::nullopt;
  }
  if (outcome == Outcome::kFailed && used + 1 < attempts_) {
    if (group.final_failure().empty() && !rounds_.final_failure(m.round)) {
      note(fmt::format(
          "worker group failed (attempt {} of {}): {}; restarting it (restart {} of {})",
          used + 1, attempts_, group.one_line_failure(), used + 1, s_.config.max_restarts));
      earlier_.push_back(fmt::format("attempt {}: {}", used + 1, group.one_line_failure()));
      return std::nullopt;
    }
    note(fmt::format(
        "not restarting ({} restart(s) left): {}; exit code {} means a usage or configuration "
        "error, which a restart would repeat",
        attempts_ - 1 - used,
        group.final_failure().empty() ? group.one_line_failure() : group.final_failure(),
        kUsageExitCode));
  }
  return end_run(group, outcome, m);
}

// The run ends with this attempt: it failed for good, or ddprun was signalled.
RunResult RoundLoop::end_run(const WorkerGroup& group, Outcome outcome, const Membership& m) {
  const std::string summary = group.summary(m.restarts + 1, attempts_, earlier_);
  if (outcome == Outcome::kInterrupted) {
    const int sig = group.interrupt_signal();
    if (group.has_root_cause()) write_all(STDERR_FILENO, summary);
    if (!group.leaving()) {
      rounds_.report_failure(m.round,
                             fmt::format("its ddprun was stopped by {}", signal_name(sig)));
    }
    rounds_.leave(m.round, true, [this] { return signalled(); });
    note(fmt::format("stopped by {}{}", signal_name(sig),
                     group.leaving() ? "; the elastic job goes on without this node" : ""));
    return RunResult{128 + sig, sig};
  }
  write_all(STDERR_FILENO, summary);
  rounds_.leave(m.round, true, [this] { return signalled(); });
  return RunResult{1, 0};
}

}  // namespace

// The launcher is the one place that knows every kind of rounds (rounds.h): a single node's own
// attempts, or the store-backed rounds of a multi-node job, fixed or elastic.
std::unique_ptr<Rounds> make_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                    const std::string& run_id, const std::string& secret) {
  if (!config.elastic && config.nnodes <= 1) return make_local_rounds();
  return make_elastic_rounds(config, base_env, run_id, secret);
}

RunResult run(const LaunchConfig& config) {
  const EnvMap base_env = current_environment();
  const std::string program_path = program_to_run(config, base_env);
  ensure_standard_fds();
  const rlimit fd_limit = raise_fd_limit();
  const std::string run_id = config.random_run_id ? random_run_id() : config.run_id;
  const std::string secret = job_secret(config, base_env);
  RunDirectory run_dir(config, run_id);
  SignalChannel signals;  // blocked from here on: before the first fork
  SubreaperScope subreaper;
  SharedState shared{config,   signals,           run_dir, base_env, program_path,
                     fd_limit, net::host_name(),
                     plan_cpu_binding(config.cpu_bind, read_cpus(allowed_cpus()),
                                      config.nproc_per_node)};
  print_startup_notes(config, base_env, run_dir, shared.binding);

  // Rounds: this node's attempts, the same on every node of the job (Note [Restart rounds]).
  std::unique_ptr<Rounds> rounds = make_rounds(config, base_env, run_id, secret);
  return RoundLoop(shared, *rounds, run_id, secret).run();
}

}  // namespace ddp::launcher
