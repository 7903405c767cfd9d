// The environment contract: where this process stands in the job.
//
// A launcher tells each process its rank through environment variables. We read, in order:
//   1. torchrun / ddprun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
//      MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT,
//      TORCHELASTIC_RUN_ID
//   2. Open MPI (mpirun):  OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
//   3. PMI (MPICH, Intel MPI hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   4. Slurm (srun): SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODEID, ...
//   5. none of these: a single process (rank 0 of 1).
// Under 2-4, MASTER_ADDR/MASTER_PORT may still be given; when absent, a single-node job uses
// 127.0.0.1 and a port derived from the launcher's job id (so all ranks agree without talking).
//
// Also read: DDP_RDZV_TIMEOUT and DDP_COLLECTIVE_TIMEOUT (seconds, may be fractional), and the
// rendezvous store's knobs (README, "The rendezvous store"): DDP_STORE_SECRET (the job's
// secret; ddprun generates one for single-node jobs), DDP_STORE_BIND, DDP_STORE_MAX_BYTES,
// DDP_AGENT_STORE ("tcpstore", torchrun's agent, or "ddp": the agent's store is a ddp-cpp one);
// the diagnostics' knobs: DDP_DEBUG (else TORCH_DISTRIBUTED_DEBUG) and DDP_FLIGHT_RECORDER.
//
// Every malformed or inconsistent value is a ddp::ConfigError naming the variable and the fix,
// raised before any socket opens. Pure functions: tests pass an EnvMap instead of the real env.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <cstdint>
#include <string>

namespace ddp {

// Which launcher's variables described this process.
enum class LaunchContract { kSingleProcess, kTorchrun, kOpenMpi, kPmi, kSlurm };
const char* to_string(LaunchContract contract);

using EnvMap = std::map<std::string, std::string, std::less<>>;

// Port used when an MPI/PMI/Slurm launch gives no MASTER_PORT and no job id to derive one from.
inline constexpr int kDefaultMasterPort = 29500;  // torchrun's default
// Ports derived from a job id fall in [kDerivedPortBase, kDerivedPortBase + kDerivedPortSpan).
inline constexpr int kDerivedPortBase = 20000;
inline constexpr int kDerivedPortSpan = 10000;

// DDP_DEBUG / TORCH_DISTRIBUTED_DEBUG: off, info (log choices and layouts) or detail (also check
// before every collective that all ranks issue the same one; more logging in DDP).
enum class DebugLevel { kOff, kInfo, kDetail };

struct DistEnv {
  LaunchContract contract = LaunchContract::kSingleProcess;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int group_rank = 0;  // the node's rank among nodes
  // Where rank 0 (or the launcher's agent) hosts the rendezvous store. Empty/0 when the job
  // is a single process and nothing was set: then no socket is ever opened.
  std::string master_addr;
  int master_port = 0;
  // torchrun's agent already hosts the store on MASTER_ADDR:MASTER_PORT: every rank, rank 0
  // included, connects as a client (TORCHELASTIC_USE_AGENT_STORE=True).
  bool use_agent_store = false;
  // DDP_AGENT_STORE=ddp: that agent's store is a ddp-cpp store (ddp-bench's extra groups, a
  // launcher of ours), not LibTorch's TCPStore (torchrun's agent).
  bool agent_store_is_ddp = false;
  // The rendezvous store's secret (DDP_STORE_SECRET): every process of the job must give the
  // same one, or none. Never printed.
  std::string store_secret;
  std::string store_bind;                   // DDP_STORE_BIND: addresses to listen on, or "any"
  std::optional<uint64_t> store_max_bytes;  // DDP_STORE_MAX_BYTES: cap on the stored bytes
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT: which attempt of the group this is
  std::string run_id;     // TORCHELASTIC_RUN_ID or the launcher's job id; may be empty
  std::optional<double> rdzv_timeout_s;        // DDP_RDZV_TIMEOUT
  std::optional<double> collective_timeout_s;  // DDP_COLLECTIVE_TIMEOUT
  DebugLevel debug = DebugLevel::kOff;         // DDP_DEBUG, else TORCH_DISTRIBUTED_DEBUG
  // DDP_FLIGHT_RECORDER: collectives each group remembers for hang reports (0: off); unset:
  // flight::kDefaultEntries (src/process_group/flight_recorder.h).
  std::optional<int> flight_recorder_entries;

  // One line for logs: "rank 1/4 (local 1/2, node 0) via torchrun; store 127.0.0.1:29500".
  std::string describe() const;
};

// Parses the contract out of `env`. Throws ddp::ConfigError on malformed/inconsistent values.
DistEnv parse_dist_env(const EnvMap& env);

// DDP_DEBUG, else TORCH_DISTRIBUTED_DEBUG, of `env` (off when neither is set). Throws
// ddp::ConfigError for another value than off/info/detail (either case).
DebugLevel parse_debug_level(const EnvMap& env);

// A copy of this process's environment, for parse_dist_env.
EnvMap current_environment();

// Positive number of seconds, e.g. "30" or "2.5"; `name` is used in the error message.
double parse_seconds(const std::string& name, const std::string& value);

}  // namespace ddp
