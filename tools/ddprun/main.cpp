// ddprun: torchrun's launcher, in C++ and without LibTorch.
//
//   ddprun --nproc-per-node 4 ./train --epochs 3
//
// Parses the command line (args.h), runs the worker group (launcher.h) and turns the outcome or
// the error into an exit code; the only place that does.
#include <sys/resource.h>  // setrlimit, to skip SIGQUIT's core dump

#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "args.h"
#include "base/log.h"
#include "ddp/env.h"  // ddp::current_environment
#include "launcher.h"

namespace {

// Ends ddprun with the signal that stopped it, so that a calling shell sees "killed by SIGINT"
// (and stops a loop on Ctrl-C) exactly as if the workers had run in the foreground.
int die_of(int signal) {
  if (signal == SIGQUIT) {
    rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
  }
  std::signal(signal, SIG_DFL);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, signal);
  ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
  std::raise(signal);
  return 128 + signal;  // only if the signal did not end us
}

}  // namespace

int main(int argc, char** argv) {
  namespace dl = ddp::launcher;
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    dl::CommandLine cl = dl::parse_command_line(args, ddp::current_environment(),
                                                dl::probe_host(ddp::current_environment()));
    if (cl.help) {
      fmt::print("{}", cl.help_text);
      return 0;
    }
    for (const std::string& n : cl.notes) ddp::log::tool("ddprun", n);
    std::fflush(stdout);
    dl::RunResult result = dl::run(cl.config);
    return result.signal != 0 ? die_of(result.signal) : result.exit_code;
  } catch (const dl::ExecError& e) {
    ddp::log::tool("ddprun", e.what());
    return e.exit_code();
  } catch (const ddp::ConfigError& e) {
    ddp::log::tool("ddprun",
                   fmt::format("error: {}\nRun 'ddprun --help' to see every flag.", e.what()));
    return dl::kUsageExitCode;
  } catch (const ddp::Error& e) {
    ddp::log::tool("ddprun", fmt::format("error: {}", e.what()));
    return 1;
  } catch (const std::exception& e) {
    ddp::log::tool("ddprun", fmt::format("internal error: {}", e.what()));
    return 1;
  }
}
