// ddprun's supervisor: starts one node's worker group, relays its output, and stops, reports on
// and restarts it (see Note [Supervision] in launcher.cpp).
//
// run() owns the process while it runs: it blocks SIGCHLD, SIGINT, SIGTERM, SIGHUP and SIGQUIT
// (they are read from a signalfd), ignores SIGPIPE and makes the process a child subreaper so
// that the workers' own children are reaped too. Call it from a single-threaded program (the
// workers' PR_SET_PDEATHSIG fires when the thread that forked them exits). Everything it started
// has been reaped when it returns or throws.
//
// Its parts: worker_group.h (one attempt of the worker group), rounds.h (the attempts every
// node runs together), process.h (fds, signals, spawning and stopping process groups), output.h
// (worker output, the run directory), summary.h (the root cause and the failure report).
#pragma once

#include "launch_config.h"  // LaunchConfig
#include "process.h"        // ExecError

namespace ddp::launcher {

// How a run ended.
struct RunResult {
  int exit_code = 0;  // 0: every worker exited 0; 1: the group failed (after all restarts)
  int signal = 0;     // non-zero: ddprun was stopped by this signal; main() should die of it
};

// Runs the worker group until it succeeds, fails for good, or ddprun is signalled.
// Throws ExecError when PROGRAM cannot be found; ddp::Error when the launcher itself cannot work
// (no temp dir, out of file descriptors...).
RunResult run(const LaunchConfig& config);

}  // namespace ddp::launcher
