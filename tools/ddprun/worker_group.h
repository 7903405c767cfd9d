// One attempt of a node's worker group: started, watched, reaped, stopped, and what its end
// was (Note [Supervision] in launcher.cpp, steps 1 to 5). Internal to ddprun.
#pragma once

#include <sys/resource.h>  // rlimit

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "args.h"      // GroupSpec
#include "cpu_bind.h"  // BindingPlan
#include "ddp/blas.h"  // BlasReport
#include "ddp/env.h"   // ddp::EnvMap
#include "launch_config.h"
#include "output.h"   // RunDirectory
#include "process.h"  // SignalChannel
#include "rounds.h"   // Rounds: the other nodes' failures, re-formings
#include "summary.h"  // WorkerEnd, RootCause

namespace ddp::launcher {

// After SIGKILL, how long to wait for the kernel to take processes down before giving up.
inline constexpr Seconds kKillWait{5.0};

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
  BlasReport blas;      // the BLAS a worker loads, for its environment (fast_blas_environment)
};

struct Worker;  // one local rank's process (worker_group.cpp)

class WorkerGroup {
 public:
  WorkerGroup(SharedState& shared, Rounds& rounds, GroupSpec group);
  // SIGKILLs and reaps whatever is left (an exception cut run() short).
  ~WorkerGroup();
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
  // The failure is final because --ft's restarts are spent (said when it happened).
  bool ft_restarts_spent() const { return ft_restarts_spent_; }
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
  void restart_failed_alone();
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
  std::chrono::steady_clock::time_point kill_deadline_;
  bool killed_ = false;
  std::string kill_reason_;  // "after the 10s grace period"
  std::chrono::steady_clock::time_point killed_at_;
  Worker* first_failure_ = nullptr;  // the failure that stopped the group; not the root cause
  int interrupt_signal_ = 0;         // first forwarded signal received
  bool warned_stuck_ = false;
  std::string failure_elsewhere_;  // another node failed first: its line from the agent store
  std::string final_failure_;      // see final_failure()
  bool ft_restarts_spent_ = false;  // see ft_restarts_spent()
  std::string regroup_;            // see regroup()
  bool leaving_ = false;           // see leaving()
  int ft_restarts_ = 0;            // --ft: workers started again alone so far

  // Set at the end of run().
  std::vector<WorkerEnd> ends_;          // one per worker, in local rank order
  std::optional<RootCause> root_cause_;  // into ends_; set when the attempt failed
};

}  // namespace ddp::launcher
