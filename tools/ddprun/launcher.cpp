// ddprun's supervisor (see launcher.h).
//
// Note [Supervision]
// One thread does everything, in one loop per attempt of the worker group (WorkerGroup, in
// worker_group.cpp):
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
// Then run() (RoundLoop) either returns (success, or ddprun was signalled), starts the next
// attempt in the next round (--max-restarts; TORCHELASTIC_RESTART_COUNT + 1; Note [Restart
// rounds] in rounds.h), or prints the root-cause summary.
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

#include <sys/random.h>  // getrandom: the job's store secret
#include <unistd.h>      // access

#include <cerrno>
#include <csignal>
#include <cstring>  // strerror
#include <memory>
#include <optional>
#include <random>  // std::random_device for run ids
#include <vector>

#include <fmt/format.h>

#include "args.h"          // GroupSpec, UsageError, sets_omp_num_threads
#include "base/net.h"      // pick_free_port, host_name, unresolvable
#include "ddp/blas.h"      // inspect_blas_apart
#include "ddp/env.h"       // current_environment
#include "elastic.h"       // make_elastic_rounds: every multi-node job's rounds
#include "output.h"        // RunDirectory, note
#include "rounds.h"        // Rounds: restarting several nodes together
#include "summary.h"       // format_seconds
#include "worker_group.h"  // WorkerGroup: one attempt

namespace ddp::launcher {
namespace {

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
  g.master_port = !m.store_addr.empty()   ? m.store_port
                  : config.pick_free_port ? net::pick_free_port()
                                          : config.master_port;
  g.run_id = run_id;
  g.restart_count = round;
  g.lineage = m.lineage;
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
    if (!group.ft_restarts_spent()) {  // else the group said so, and the budget is the same
      note(fmt::format(
          "not restarting ({} restart(s) left): {}; exit code {} means a usage or configuration "
          "error, which a restart would repeat",
          attempts_ - 1 - used,
          group.final_failure().empty() ? group.one_line_failure() : group.final_failure(),
          kUsageExitCode));
    }
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
  if (!config.elastic && config.nnodes <= 1) {
    return make_local_rounds(config, base_env, run_id, secret);
  }
  return make_elastic_rounds(config, base_env, run_id, secret);
}

RunResult run(const LaunchConfig& config) {
  const EnvMap base_env = current_environment();
  // Before any thread starts: it forks.
  BlasReport blas = inspect_blas_apart();
  const std::string program_path = program_to_run(config, base_env);
  ensure_standard_fds();
  const rlimit fd_limit = raise_fd_limit();
  const std::string run_id = config.random_run_id ? random_run_id() : config.run_id;
  const std::string secret = job_secret(config, base_env);
  RunDirectory run_dir(config, run_id);
  SignalChannel signals;  // blocked from here on: before the first fork
  SubreaperScope subreaper;
  SharedState shared{config,
                     signals,
                     run_dir,
                     base_env,
                     program_path,
                     fd_limit,
                     net::host_name(),
                     plan_cpu_binding(config.cpu_bind, read_cpus(allowed_cpus()),
                                      config.nproc_per_node),
                     std::move(blas)};
  print_startup_notes(config, base_env, run_dir, shared.binding);

  // Rounds: this node's attempts, the same on every node of the job (Note [Restart rounds]).
  std::unique_ptr<Rounds> rounds = make_rounds(config, base_env, run_id, secret);
  return RoundLoop(shared, *rounds, run_id, secret).run();
}

}  // namespace ddp::launcher
