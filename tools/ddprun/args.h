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

#include <chrono>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cpu_bind.h"   // CpuBind
#include "ddp/env.h"    // ddp::EnvMap
#include "ddp/error.h"  // ddp::ConfigError

namespace ddp::launcher {

// The command line is wrong (unknown flag, bad value, inconsistent flags): nothing was started.
// ddprun exits with kUsageExitCode.
class UsageError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};
inline constexpr int kUsageExitCode = 2;  // like argparse, getopt tools and torchrun

inline constexpr int kDefaultNprocPerNode = 1;
inline constexpr int kDefaultNnodes = 1;
inline constexpr const char* kDefaultMasterAddr = "127.0.0.1";
inline constexpr int kDefaultRdzvPort = 29400;  // torchrun's port for a bare --rdzv-endpoint host
inline constexpr const char* kDefaultRunId = "none";  // torchrun's --rdzv-id default
inline constexpr const char* kDefaultRole = "default";
inline constexpr int kDefaultMaxRestarts = 0;
// Durations as given on the command line: seconds, fractions allowed.
using Seconds = std::chrono::duration<double>;
inline constexpr Seconds kDefaultMonitorInterval{0.1};        // torchrun's since pytorch#124692
inline constexpr Seconds kDefaultGracePeriod{10.0};           // between SIGTERM and SIGKILL
// Elastic rounds: once MIN nodes are in, how long a round waits for more (torchrun's default).
inline constexpr Seconds kDefaultLastCallTimeout{30.0};
inline constexpr const char* kPythonInterpreter = "python3";  // for PROGRAM.py and -m

enum class RdzvBackend { kStatic, kC10d };

// Which of a worker's streams a flag applies to; torchrun's Std (1=stdout, 2=stderr, 3=both).
enum class Std : std::uint8_t { kNone = 0, kOut = 1, kErr = 2, kAll = 3 };
inline bool has(Std set, Std stream) {
  return (static_cast<unsigned>(set) & static_cast<unsigned>(stream)) != 0;
}

// --redirects / --tee: one value for every local rank ("3") or one per local rank ("0:1,1:2";
// local ranks not listed get kNone).
struct StdSpec {
  Std all = Std::kNone;
  std::map<int, Std> by_local_rank;

  Std for_local_rank(int local_rank) const;
  bool any() const;  // does any rank have a stream selected?
};

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

// Everything ddprun needs to launch and supervise one node's worker group.
struct LaunchConfig {
  // --- the group's shape
  int nproc_per_node = kDefaultNprocPerNode;  // P: workers on this node
  int nnodes = kDefaultNnodes;                // N: nodes in the job (elastic: at most)
  int node_rank = 0;                          // K: this node; global rank = K * P + local rank
  // Elastic (Note [Elastic rounds] in elastic.h): --rdzv-backend c10d with --nnodes MIN:MAX, or
  // without --node-rank. The nodes present form each round, between min_nodes and nnodes, and
  // node ranks are given out at each round; node_rank above is unused.
  bool elastic = false;
  int min_nodes = kDefaultNnodes;
  Seconds last_call_timeout = kDefaultLastCallTimeout;  // --rdzv-conf last_call_timeout

  // --- where rank 0 hosts the store (MASTER_ADDR/MASTER_PORT) and the run's name
  std::string master_addr = kDefaultMasterAddr;
  // Where master_addr came from when no flag gave it (Slurm's node list): ddprun checks that
  // such a name resolves before it starts, and names the variable when it does not.
  std::string master_addr_source;
  int master_port = kDefaultMasterPort;
  bool pick_free_port = false;  // --standalone or port 0: pick one on 127.0.0.1 per attempt
  std::string run_id = kDefaultRunId;
  bool random_run_id = false;  // --standalone: the launcher draws a fresh id
  RdzvBackend rdzv_backend = RdzvBackend::kStatic;
  std::map<std::string, std::string> rdzv_conf;  // --rdzv-conf k=v,... as given
  std::string role = kDefaultRole;

  // --- timeouts exported to the workers (DDP_RDZV_TIMEOUT, DDP_COLLECTIVE_TIMEOUT)
  std::optional<Seconds> rdzv_timeout;
  std::optional<Seconds> collective_timeout;
  // --- the workers' collective backend (DDP_BACKEND): gloo, shm, nccl or auto; empty: unset
  std::string backend;
  // --- pinning each worker to its CPUs (Note [CPU binding] in cpu_bind.h)
  CpuBind cpu_bind = CpuBind::kNone;

  // --- supervision
  int max_restarts = kDefaultMaxRestarts;
  Seconds monitor_interval = kDefaultMonitorInterval;
  Seconds grace_period = kDefaultGracePeriod;

  // --- output
  std::string log_dir;                              // empty: no --log-dir
  StdSpec redirects;                                // streams written to files only
  StdSpec tee;                                      // streams written to files and shown
  std::optional<std::set<int>> local_ranks_filter;  // local ranks shown on the console

  // --- what each worker runs
  std::string program;                   // PROGRAM as given
  bool module = false;                   // -m: PROGRAM is a Python module
  bool via_python = false;               // worker_argv starts with "python3 -u" (.py or -m)
  // The workers are Python: via_python, or PROGRAM is a Python interpreter (`ddprun python3
  // x.py`, `--no-python python3 ...`). Their TCPStore clients cannot use our agent store
  // (Note [Restart rounds]).
  bool python_worker = false;
  std::vector<std::string> worker_argv;  // what to exec: {"python3", "-u", "x.py", "--lr", "1"}

  int world_size() const { return nnodes * nproc_per_node; }
  bool shows_on_console(int local_rank, Std stream) const;
  bool writes_to_file(int local_rank, Std stream) const;
  bool any_log_files() const { return redirects.any() || tee.any(); }
};

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

// "--redirects 0:1,1:2" and friends; `flag` names the flag in errors. Throws UsageError.
StdSpec parse_std_spec(const std::string& flag, const std::string& value);

// host[:port] or [v6addr][:port]; port defaults to kDefaultRdzvPort. Throws UsageError.
struct Endpoint {
  std::string host;
  int port = kDefaultRdzvPort;
};
Endpoint parse_endpoint(const std::string& flag, const std::string& value);

// What one attempt of the group shares: decided by the launcher at run time.
struct GroupSpec {
  int node_rank = 0;  // this node's rank in the attempt (elastic: given out at each round)
  int nnodes = 1;     // nodes in the attempt
  std::string master_addr;
  int master_port = 0;
  std::string run_id;
  int restart_count = 0;     // 0 on the first attempt
  std::string store_secret;  // DDP_STORE_SECRET for the workers; empty: none (Note [Job secret])
  // The workers' store is the agent's, hosted by node 0's ddprun (several nodes: Note [Restart
  // rounds] in rounds.h); false: global rank 0 hosts it.
  bool agent_store = false;
};

// The full environment of local rank `local_rank`: `base` plus the torchrun contract
// (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR...), see Note [Worker environment] in args.cpp.
EnvMap worker_environment(const LaunchConfig& config, const GroupSpec& group, int local_rank,
                          const std::string& error_file, const EnvMap& base);

// True when worker_environment() sets OMP_NUM_THREADS=1 (P > 1 and `base` has none).
bool sets_omp_num_threads(const LaunchConfig& config, const EnvMap& base);

}  // namespace ddp::launcher
