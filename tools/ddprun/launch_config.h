// ddprun's configuration: what one node's launch is decided from (LaunchConfig), its defaults
// and value types, and the error for a command line that cannot give one.
//
// Its own header so that what reads a configuration (the launcher, the rounds, the output) does
// not depend on how the command line is parsed (args.h, flags.h, values.h), and so that the
// parsers share these types without including each other.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cpu_bind.h"   // CpuBind
#include "ddp/env.h"    // kDefaultMasterPort, ddp::EnvMap
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

enum class RdzvBackend { kStatic, kC10d, kEtcd };

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

// Everything ddprun needs to launch and supervise one node's worker group.
struct LaunchConfig {
  // --- the group's shape
  int nproc_per_node = kDefaultNprocPerNode;  // P: workers on this node
  int nnodes = kDefaultNnodes;                // N: nodes in the job (elastic: at most)
  int node_rank = 0;                          // K: this node; global rank = K * P + local rank
  // Elastic (Note [Elastic rounds] in elastic.h): --rdzv-backend c10d with --nnodes MIN:MAX, or
  // without --node-rank. The nodes present form each round, between min_nodes and nnodes, and
  // node ranks are given out at each round; node_rank above is unused. Otherwise several nodes
  // are a fixed job: MIN = MAX = nnodes, node ranks given (Note [Membership policy]).
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
  // --rdzv-backend etcd: the cluster's client endpoints, as --rdzv-endpoint gave them (Note
  // [etcd backend] in etcd.h); master_addr and master_port are then not the rendezvous's.
  std::string etcd_endpoints;
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
  // --ft (Note [Per-step fault tolerance] in ddp/fault_tolerance.h): the workers' store outlives
  // them (their coordination store: a single node's ddprun hosts it, as node 0's hosts a fixed
  // job's agent store), and a worker that fails is started again alone while the others go on,
  // at most max_restarts times in all on each node. A fixed number of nodes; a node's ddprun
  // started again takes its earlier one's place in the round (Note [Membership policy]).
  bool ft = false;

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

}  // namespace ddp::launcher
