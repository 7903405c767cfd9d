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
// Every other variable ddp-cpp reads is a knob of kEnvKnobs below (Note [Environment knobs]).
//
// Every malformed or inconsistent value is a ddp::ConfigError naming the variable and the fix,
// raised before any socket opens. Pure functions: tests pass an EnvMap instead of the real env.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

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
  // Where master_addr came from, for errors: empty for MASTER_ADDR (or the single-node
  // default); e.g. "the first node of SLURM_STEP_NODELIST='gpu[07-08]'" when a launcher's node
  // list gave it (such a name must resolve: the rendezvous checks it at once).
  std::string master_addr_source;
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
  // DDP_RUN_LINEAGE: which instance of the job (ddprun; Note [Run folder lease] in
  // ddp/run_lease.h); empty under other launchers.
  std::string run_lineage;
  std::optional<std::chrono::milliseconds> rdzv_timeout;        // DDP_RDZV_TIMEOUT
  std::optional<std::chrono::milliseconds> collective_timeout;  // DDP_COLLECTIVE_TIMEOUT
  DebugLevel debug = DebugLevel::kOff;  // DDP_DEBUG, else TORCH_DISTRIBUTED_DEBUG
  // DDP_FLIGHT_RECORDER: collectives each group remembers for hang reports (0: off); unset:
  // the default of kEnvKnobs' row below.
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
std::chrono::milliseconds parse_seconds(const std::string& name, const std::string& value);

// DDP_STORE_MAX_BYTES of `env` (a size: "268435456", "256M", "1G"); nullopt when unset or empty.
// Throws ddp::ConfigError for another value. The same rule for rank 0's store and ddprun's.
std::optional<uint64_t> parse_store_max_bytes(const EnvMap& env);

// Note [Environment knobs]
// A rank that has not joined within this time is reported missing. Multi-node jobs start
// their nodes at different moments, so this is generous; tests set 1-2 s.
inline constexpr std::chrono::seconds kDefaultRendezvousTimeout{300};
// A collective whose peers do not arrive within this time fails (NCCL's default in PyTorch 2).
inline constexpr std::chrono::seconds kDefaultCollectiveTimeout{600};

// Besides the launch contract above, these variables tune ddp-cpp. This table is the one list:
// env_knob() reads no other name, the "Environment knobs" table of docs/errors-and-environment.md
// shows the same rows (a test checks both, and that no other part of ddp-cpp reads the
// environment directly). Options in code (InitOptions, DDPOptions, flags)
// win over knobs.
struct EnvKnob {
  std::string_view name;
  std::string_view default_value;
  std::string_view meaning;
};
inline constexpr EnvKnob kEnvKnobs[] = {
    {"DDP_RDZV_TIMEOUT", "300", "seconds every rank waits for the others to join (fractions ok)"},
    {"DDP_COLLECTIVE_TIMEOUT", "600", "seconds one collective may take before it fails, named"},
    {"DDP_BACKEND", "auto",
     "transport: auto (shm on one host, shm+gloo across hosts), shm, gloo, shm+gloo, nccl, "
     "tuned (auto, shm+gloo's all_reduce route measured), or one per device (cpu:gloo,cuda:nccl)"},
    {"DDP_DEBUG", "off",
     "off, info (bucket layout, chosen transport), detail (also per-iteration checks)"},
    {"TORCH_DISTRIBUTED_DEBUG", "off",
     "PyTorch's name for DDP_DEBUG, read when DDP_DEBUG is unset"},
    {"DDP_SHM_CHUNK_BYTES", "262144", "shm staging chunk, a multiple of 64 (tests and tuning)"},
    {"DDP_STORE_SECRET", "(none)", "the job's rendezvous-store secret; ddprun generates one"},
    {"DDP_STORE_BIND", "(the job's address)", "addresses the store listens on, or any"},
    {"DDP_STORE_MAX_BYTES", "268435456", "cap on the bytes the rendezvous store holds"},
    {"DDP_RUN_LINEAGE", "(set by ddprun)",
     "which instance of the job a group belongs to, for the run folder's lease"},
    {"DDP_RUN_LEASE_TTL", "10",
     "seconds a run folder's lease lasts unrenewed before another group may take it"},
    {"DDP_AGENT_STORE", "tcpstore",
     "what the launcher's agent store is: tcpstore (torchrun) or ddp"},
    {"GLOO_SOCKET_IFNAME", "(routes to MASTER_ADDR)", "network interface Gloo uses"},
    {"TORCHELASTIC_ERROR_FILE", "(set by ddprun)", "where a failing process records its error"},
    {"OMP_NUM_THREADS", "CPUs / local ranks",
     "threads per rank, LibTorch's and the BLAS's (ddprun sets 1 for several workers)"},
    {"OMP_WAIT_POLICY", "(passive, see BLAS)",
     "OpenMP idle threads; ddp::ensure_fast_blas (or ddprun) sets passive beside OpenBLAS's own"},
    {"OPENBLAS_THREAD_TIMEOUT", "(4, see BLAS)",
     "OpenBLAS idle threads spin 2^N cycles; ddp::ensure_fast_blas (or ddprun) sets 4 beside "
     "OpenMP"},
    {"DDP_PROCESS_DEFAULTS", "1",
     "0: init_process_group leaves threads, malloc and uncaught errors to the program"},
    {"USE_LIBUV", "1", "LibTorch 2.x TCPStore: libuv or classic (falls back when libuv is absent)"},
    {"CUDA_VISIBLE_DEVICES", "(all)",
     "CUDA devices a rank sees; nccl ranks bind cuda:LOCAL_RANK among them"},
    {"OPENBLAS_CORETYPE", "(CPU's best)",
     "OpenBLAS kernel; ddp::ensure_fast_blas (or ddprun, for its workers) sets it when unset"},
    {"DDP_FLIGHT_RECORDER", "256", "collectives each group remembers for hang reports (0: off)"},
    {"TMPDIR", "/tmp", "where ddprun makes a log folder for --redirects/--tee without --log-dir"},
};

// The value of knob `name` (which must be a row of kEnvKnobs: a ddp::Error otherwise), or
// nullopt when it is unset or empty.
std::optional<std::string> env_knob(std::string_view name);

// parse_debug_level of this process's environment.
DebugLevel debug_level_from_env();

}  // namespace ddp
