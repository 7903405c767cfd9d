// ddprun's configuration: the command line in, a LaunchConfig and each worker's environment out.
//
// Pure functions: no processes, no sockets, no reads of the real environment. The caller passes
// the environment (for the PET_* fallbacks and as the base of the workers' environment) and what
// the host has (CPUs, GPUs), so tests can check every path without launching anything.
//
// Flags follow torchrun (torch/distributed/run.py): every multi-word flag has a dash and an
// underscore spelling, and each one can also come from PET_<NAME> (PET_NPROC_PER_NODE=2); the
// command line wins. Errors are UsageError (a ddp::ConfigError) naming the flag, the value and
// where it came from, and saying what would be accepted.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ddp/env.h"        // ddp::EnvMap
#include "launch_config.h"  // LaunchConfig, UsageError, the defaults
#include "values.h"         // parse_std_spec, parse_endpoint

namespace ddp::launcher {

// What the host offers, for --nproc-per-node auto|cpu|gpu.
struct HostInfo {
  int cpus = 1;  // online CPUs
  int gpus = 0;  // CUDA devices visible to the workers (CUDA_VISIBLE_DEVICES applied)
  // When set, counts them instead of `gpus`, only if --nproc-per-node asks (gpu, auto).
  std::function<int()> count_gpus;
  int visible_gpus() const { return count_gpus ? count_gpus() : gpus; }
};
// Online CPUs now, and how to count the CUDA devices the workers will see, as torchrun counts
// them (torch.cuda.device_count()) but without CUDA in the launcher: the driver's own count
// (libcuda.so.1's cuInit + cuDeviceGetCount, which apply CUDA_VISIBLE_DEVICES), asked in a
// short-lived child process so that no driver thread or state stays in ddprun (a driver thread
// would take the SIGTERM ddprun forwards to its workers); without a driver, the NVIDIA devices
// of /proc/driver/nvidia/gpus filtered by CUDA_VISIBLE_DEVICES.
HostInfo probe_host(const EnvMap& env);
// How many of `physical` devices CUDA_VISIBLE_DEVICES (unset: all) leaves visible: its entries
// up to the first invalid one (CUDA's rule), an index being valid when below `physical`,
// "GPU-..."/"MIG-..." UUIDs counted as valid, duplicates invalid.
int visible_gpus(int physical, const std::optional<std::string>& cuda_visible_devices);

// The result of parsing: either help text to print, or a configuration to run.
struct CommandLine {
  bool help = false;
  std::string help_text;
  LaunchConfig config;
  std::vector<std::string> notes;  // things worth one line on stderr (flags that were ignored...)
};

// Parses `args` (argv without argv[0]). `env` supplies the PET_* fallbacks.
// Throws UsageError.
CommandLine parse_command_line(const std::vector<std::string>& args, const EnvMap& env,
                               const HostInfo& host);

// The help text (same as --help).
std::string help_text();

// What one attempt of the group shares: decided by the launcher at run time.
struct GroupSpec {
  int node_rank = 0;  // this node's rank in the attempt (elastic: given out at each round)
  int nnodes = 1;     // nodes in the attempt
  std::string master_addr;
  int master_port = 0;
  std::string run_id;
  int restart_count = 0;     // 0 on the first attempt
  std::string lineage;       // DDP_RUN_LINEAGE: which instance of the job (Membership::lineage)
  std::string store_secret;  // DDP_STORE_SECRET for the workers; empty: none (Note [Job secret])
  // The workers' store is the agent's, hosted by a ddprun of the job (several nodes: Note
  // [Restart rounds] in rounds.h); false: global rank 0 hosts it.
  bool agent_store = false;
};

// The full environment of local rank `local_rank`: `base` plus the torchrun contract
// (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR...), see Note [Worker environment] in worker_env.cpp.
EnvMap worker_environment(const LaunchConfig& config, const GroupSpec& group, int local_rank,
                          const std::string& error_file, const EnvMap& base);

// True when worker_environment() sets OMP_NUM_THREADS=1 (P > 1 and `base` has none).
bool sets_omp_num_threads(const LaunchConfig& config, const EnvMap& base);

}  // namespace ddp::launcher
