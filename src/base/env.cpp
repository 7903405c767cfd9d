// Parsing of the launch environment contract (see include/ddp/env.h).
#include "ddp/env.h"

#include <algorithm>
#include <cctype>    // std::isdigit
#include <charconv>  // std::from_chars
#include <cmath>     // std::isfinite
#include <cstdlib>   // strtod
#include <functional>
#include <vector>

#include <fmt/format.h>

#include "base/check.h"
#include "base/parse.h"

extern char** environ;

namespace ddp {
namespace {

const std::string* find(const EnvMap& env, std::string_view name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

// An integer in [lo, hi] read from variable `name`; `hint` says where the value comes from.
int parse_int(const std::string& name, const std::string& value, int lo, int hi,
              std::string_view hint) {
  const std::optional<long long> out = parse::integer(value);
  DDP_CHECK(out.has_value(), ConfigError, "invalid environment: {}='{}' is not an integer ({})",
            name, value, hint);
  DDP_CHECK(*out >= lo && *out <= hi, ConfigError,
            "invalid environment: {}={} is out of range [{}, {}] ({})", name, *out, lo, hi, hint);
  return static_cast<int>(*out);
}

std::optional<int> get_int(const EnvMap& env, const std::string& name, int lo, int hi,
                           std::string_view hint) {
  const std::string* v = find(env, name);
  if (v == nullptr) return std::nullopt;
  return parse_int(name, *v, lo, hi, hint);
}

int require_int(const EnvMap& env, const std::string& name, int lo, int hi, std::string_view hint) {
  auto v = get_int(env, name, lo, hi, hint);
  DDP_CHECK(v.has_value(), ConfigError, "invalid environment: {} is not set ({})", name, hint);
  return *v;
}

bool parse_bool(const std::string& name, const std::string& value) {
  const std::optional<bool> out = parse::boolean(value);
  DDP_CHECK(out.has_value(), ConfigError,
            "invalid environment: {}='{}' is not a boolean (use True/False or 1/0)", name, value);
  return *out;
}

constexpr int kMaxWorld = 1 << 20;
constexpr int kMaxPort = 65535;
constexpr std::string_view kTorchrunHint =
    "set by torchrun/ddprun; a manual launch needs RANK, WORLD_SIZE, MASTER_ADDR and "
    "MASTER_PORT on every process";

// MASTER_ADDR/MASTER_PORT for launchers that do not set them (MPI, PMI, Slurm).
// `single_node`: every rank is on this host, so 127.0.0.1 works. `job_id` seeds the port so
// that all ranks of one job agree on it without communicating.
void fill_master_endpoint(const EnvMap& env, DistEnv& out, bool single_node,
                          const std::string& job_id, std::string_view first_host) {
  if (const std::string* addr = find(env, "MASTER_ADDR"); addr != nullptr && !addr->empty()) {
    out.master_addr = *addr;
  } else if (single_node) {
    out.master_addr = "127.0.0.1";
  } else if (!first_host.empty()) {
    out.master_addr = std::string(first_host);
  } else {
    throw ConfigError(fmt::format(
        "invalid environment: {} started {} ranks on several nodes but MASTER_ADDR is not set; "
        "export MASTER_ADDR=<address of the node running rank 0> (with mpirun: -x MASTER_ADDR)",
        to_string(out.contract), out.world_size));
  }
  if (auto port = get_int(env, "MASTER_PORT", 1, kMaxPort, "the rendezvous port")) {
    out.master_port = *port;
  } else if (!job_id.empty()) {
    out.master_port =
        kDerivedPortBase + static_cast<int>(std::hash<std::string>{}(job_id) % kDerivedPortSpan);
  } else {
    out.master_port = kDefaultMasterPort;
  }
  if (out.run_id.empty()) out.run_id = job_id;
}

// First host of a Slurm node list: "node[03-05,9],gpu7" -> "node03"; "a,b" -> "a".
std::string first_slurm_host(const std::string& list) {
  std::string host;
  for (size_t i = 0; i < list.size(); ++i) {
    char c = list[i];
    if (c == ',') break;
    if (c == '[') {
      size_t j = i + 1;
      while (j < list.size() && list[j] != '-' && list[j] != ',' && list[j] != ']') {
        host += list[j++];
      }
      break;
    }
    host += c;
  }
  return host;
}

void parse_torchrun(const EnvMap& env, DistEnv& out) {
  out.contract = LaunchContract::kTorchrun;
  out.world_size = require_int(env, "WORLD_SIZE", 1, kMaxWorld, kTorchrunHint);
  out.rank = require_int(env, "RANK", 0, kMaxWorld, kTorchrunHint);
  DDP_CHECK(out.rank < out.world_size, ConfigError,
            "invalid environment: RANK={} but WORLD_SIZE={}; ranks are numbered 0..{} (each "
            "process needs a distinct RANK below WORLD_SIZE)",
            out.rank, out.world_size, out.world_size - 1);
  // Without LOCAL_* we assume a single node: local rank = rank.
  out.local_world_size =
      get_int(env, "LOCAL_WORLD_SIZE", 1, kMaxWorld, kTorchrunHint).value_or(out.world_size);
  out.local_rank = get_int(env, "LOCAL_RANK", 0, kMaxWorld, kTorchrunHint)
                       .value_or(out.rank % out.local_world_size);
  DDP_CHECK(out.local_world_size <= out.world_size, ConfigError,
            "invalid environment: LOCAL_WORLD_SIZE={} exceeds WORLD_SIZE={}", out.local_world_size,
            out.world_size);
  DDP_CHECK(out.local_rank < out.local_world_size, ConfigError,
            "invalid environment: LOCAL_RANK={} but LOCAL_WORLD_SIZE={}; local ranks are "
            "numbered 0..{}",
            out.local_rank, out.local_world_size, out.local_world_size - 1);
  out.group_rank = get_int(env, "GROUP_RANK", 0, kMaxWorld, kTorchrunHint)
                       .value_or(out.rank / out.local_world_size);
  out.restart_count =
      get_int(env, "TORCHELASTIC_RESTART_COUNT", 0, 1 << 30, kTorchrunHint).value_or(0);
  if (const std::string* v = find(env, "TORCHELASTIC_RUN_ID")) out.run_id = *v;
  if (const std::string* v = find(env, "DDP_RUN_LINEAGE")) out.run_lineage = *v;
  if (const std::string* v = find(env, "TORCHELASTIC_USE_AGENT_STORE")) {
    out.use_agent_store = parse_bool("TORCHELASTIC_USE_AGENT_STORE", *v);
  }

  const std::string* addr = find(env, "MASTER_ADDR");
  const bool need_store = out.world_size > 1 || out.use_agent_store;
  DDP_CHECK(!need_store || (addr != nullptr && !addr->empty()), ConfigError,
            "invalid environment: WORLD_SIZE={} but MASTER_ADDR is not set; every rank needs "
            "MASTER_ADDR and MASTER_PORT naming the host:port where rank 0 runs the rendezvous "
            "store (ddprun and torchrun set both)",
            out.world_size);
  if (addr != nullptr) out.master_addr = *addr;
  auto port = get_int(env, "MASTER_PORT", 1, kMaxPort, "the rendezvous port of rank 0's store");
  DDP_CHECK(!need_store || port.has_value(), ConfigError,
            "invalid environment: WORLD_SIZE={} but MASTER_PORT is not set; set it to a free "
            "port on MASTER_ADDR, the same on every rank (or launch with ddprun --standalone)",
            out.world_size);
  out.master_port = port.value_or(0);
}

void parse_open_mpi(const EnvMap& env, DistEnv& out) {
  out.contract = LaunchContract::kOpenMpi;
  const auto hint = "set by Open MPI's mpirun";
  out.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", 1, kMaxWorld, hint);
  out.rank = require_int(env, "OMPI_COMM_WORLD_RANK", 0, out.world_size - 1, hint);
  out.local_world_size =
      get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, out.world_size, hint).value_or(1);
  out.local_rank =
      get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, out.local_world_size - 1, hint).value_or(0);
  out.group_rank = out.rank / out.local_world_size;
  const std::string* job = find(env, "OMPI_MCA_ess_base_jobid");
  if (job == nullptr) job = find(env, "PMIX_NAMESPACE");
  fill_master_endpoint(env, out, out.local_world_size == out.world_size, job ? *job : "", "");
}

void parse_pmi(const EnvMap& env, DistEnv& out) {
  out.contract = LaunchContract::kPmi;
  const auto hint = "set by the PMI launcher (mpiexec/hydra)";
  out.world_size = require_int(env, "PMI_SIZE", 1, kMaxWorld, hint);
  out.rank = require_int(env, "PMI_RANK", 0, out.world_size - 1, hint);
  out.local_world_size = get_int(env, "MPI_LOCALNRANKS", 1, out.world_size, hint).value_or(1);
  out.local_rank = get_int(env, "MPI_LOCALRANKID", 0, out.local_world_size - 1, hint).value_or(0);
  out.group_rank = out.rank / out.local_world_size;
  const std::string* job = find(env, "PMI_JOBID");
  fill_master_endpoint(env, out, out.local_world_size == out.world_size, job ? *job : "", "");
}

// Slurm's tasks-per-node list, "2(x3),1" -> {2, 2, 2, 1}; nullopt when malformed.
std::optional<std::vector<int>> expand_tasks_per_node(const std::string& spec) {
  std::vector<int> out;
  size_t i = 0;
  auto number = [&]() -> std::optional<long long> {
    const size_t start = i;
    while (i < spec.size() && std::isdigit(static_cast<unsigned char>(spec[i]))) ++i;
    if (i == start || i - start > 7) return std::nullopt;
    return std::stoll(spec.substr(start, i - start));
  };
  while (i < spec.size()) {
    const std::optional<long long> tasks = number();
    if (!tasks || *tasks < 1) return std::nullopt;
    long long times = 1;
    if (spec.compare(i, 2, "(x") == 0) {
      i += 2;
      const std::optional<long long> n = number();
      if (!n || *n < 1 || i >= spec.size() || spec[i] != ')') return std::nullopt;
      ++i;
      times = *n;
    }
    if (static_cast<long long>(out.size()) + times > kMaxWorld) return std::nullopt;
    out.insert(out.end(), static_cast<size_t>(times), static_cast<int>(*tasks));
    if (i == spec.size()) break;
    if (spec[i] != ',') return std::nullopt;
    ++i;
    if (i == spec.size()) return std::nullopt;
  }
  if (out.empty()) return std::nullopt;
  return out;
}

// srun's step: SLURM_STEP_* describe this step (an sbatch job's SLURM_NTASKS and
// SLURM_NTASKS_PER_NODE describe the allocation and reach a smaller step unchanged).
void parse_slurm(const EnvMap& env, DistEnv& out) {
  out.contract = LaunchContract::kSlurm;
  const auto hint = "set by Slurm's srun";
  out.world_size = require_int(env, "SLURM_STEP_NUM_TASKS", 1, kMaxWorld, hint);
  out.rank = require_int(env, "SLURM_PROCID", 0, out.world_size - 1, hint);
  const int nodes = get_int(env, "SLURM_STEP_NUM_NODES", 1, kMaxWorld, hint).value_or(1);
  DDP_CHECK(nodes <= out.world_size, ConfigError,
            "invalid environment: SLURM_STEP_NUM_NODES={} exceeds SLURM_STEP_NUM_TASKS={} (a "
            "step has at least one task per node)",
            nodes, out.world_size);
  out.group_rank = get_int(env, "SLURM_NODEID", 0, nodes - 1, hint).value_or(0);
  out.local_rank = get_int(env, "SLURM_LOCALID", 0, kMaxWorld, hint).value_or(0);
  // Tasks on this node: the step's list, exact for any distribution; else an even split.
  if (const std::string* spec = find(env, "SLURM_STEP_TASKS_PER_NODE")) {
    const std::optional<std::vector<int>> per_node = expand_tasks_per_node(*spec);
    DDP_CHECK(per_node, ConfigError,
              "invalid environment: SLURM_STEP_TASKS_PER_NODE='{}' is not a Slurm task list "
              "(e.g. 2(x3),1) ({})",
              *spec, hint);
    long long total = 0;
    for (int n : *per_node) total += n;
    DDP_CHECK(static_cast<int>(per_node->size()) == nodes && total == out.world_size, ConfigError,
              "invalid environment: SLURM_STEP_TASKS_PER_NODE='{}' lists {} task(s) on {} "
              "node(s), but SLURM_STEP_NUM_TASKS={} and SLURM_STEP_NUM_NODES={}: the variables "
              "come from different steps (was one of them exported into this step by hand?)",
              *spec, total, per_node->size(), out.world_size, nodes);
    out.local_world_size = (*per_node)[static_cast<size_t>(out.group_rank)];
  } else {
    out.local_world_size = (out.world_size + nodes - 1) / nodes;
  }
  DDP_CHECK(out.local_rank < out.local_world_size, ConfigError,
            "invalid environment: SLURM_LOCALID={} but this node runs {} task(s) of the step "
            "(SLURM_STEP_TASKS_PER_NODE, node SLURM_NODEID={}); local ranks are 0..{}",
            out.local_rank, out.local_world_size, out.group_rank, out.local_world_size - 1);
  const std::string* job = find(env, "SLURM_JOB_ID");
  const char* list_name = "SLURM_STEP_NODELIST";
  const std::string* nodelist = find(env, list_name);
  if (nodelist == nullptr) {
    list_name = "SLURM_JOB_NODELIST";
    nodelist = find(env, list_name);
  }
  const std::string first = nodelist ? first_slurm_host(*nodelist) : std::string();
  fill_master_endpoint(env, out, nodes == 1, job ? *job : "", first);
  const std::string* addr = find(env, "MASTER_ADDR");
  if (!first.empty() && nodes > 1 && (addr == nullptr || addr->empty())) {
    out.master_addr_source = fmt::format("the first node of {}='{}'", list_name, *nodelist);
  }
}

// The rendezvous store's variables (include/ddp/env.h; docs/store-and-security.md).
void parse_store_knobs(const EnvMap& env, DistEnv& out) {
  if (const std::string* v = find(env, "DDP_AGENT_STORE"); v != nullptr && !v->empty()) {
    DDP_CHECK(*v == "ddp" || *v == "tcpstore", ConfigError,
              "invalid environment: DDP_AGENT_STORE='{}': use 'tcpstore' (the launcher's agent "
              "hosts LibTorch's TCPStore, as torchrun does) or 'ddp' (a ddp-cpp store)",
              *v);
    out.agent_store_is_ddp = *v == "ddp";
  }
  if (const std::string* v = find(env, "DDP_STORE_SECRET")) out.store_secret = *v;
  if (const std::string* v = find(env, "DDP_STORE_BIND")) out.store_bind = *v;
  out.store_max_bytes = parse_store_max_bytes(env);
}

}  // namespace

std::optional<uint64_t> parse_store_max_bytes(const EnvMap& env) {
  const std::string* v = find(env, "DDP_STORE_MAX_BYTES");
  if (v == nullptr || v->empty()) return std::nullopt;
  const std::optional<uint64_t> bytes = parse::byte_size(*v);
  DDP_CHECK(bytes, ConfigError,
            "invalid environment: DDP_STORE_MAX_BYTES='{}' is not a size in bytes (e.g. "
            "268435456, 256M or 1G)",
            *v);
  return bytes;
}

const char* to_string(LaunchContract contract) {
  switch (contract) {
    case LaunchContract::kSingleProcess: return "single process";
    case LaunchContract::kTorchrun: return "torchrun/ddprun";
    case LaunchContract::kOpenMpi: return "Open MPI";
    case LaunchContract::kPmi: return "PMI";
    case LaunchContract::kSlurm: return "Slurm";
  }
  return "?";
}

std::chrono::milliseconds parse_seconds(const std::string& name, const std::string& value) {
  const std::optional<double> s = parse::seconds(value);
  DDP_CHECK(s.has_value(), ConfigError,
            "invalid value: {}='{}' is not a positive number of seconds (at most 1e9)", name,
            value);
  // At least 1 ms: a positive timeout never rounds down to "no time at all".
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(*s * 1000.0)));
}

std::optional<std::string> env_knob(std::string_view name) {
  bool known = false;
  for (const EnvKnob& k : kEnvKnobs) known = known || k.name == name;
  DDP_CHECK(known, Error, "env_knob({}): not a row of kEnvKnobs (include/ddp/env.h)", name);
  const char* v = std::getenv(std::string(name).c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

DebugLevel debug_level_from_env() { return parse_debug_level(current_environment()); }

DistEnv parse_dist_env(const EnvMap& env) {
  DistEnv out;
  if (find(env, "RANK") || find(env, "WORLD_SIZE")) {
    parse_torchrun(env, out);
  } else if (find(env, "OMPI_COMM_WORLD_RANK")) {
    parse_open_mpi(env, out);
  } else if (find(env, "PMI_RANK")) {
    parse_pmi(env, out);
  } else if (find(env, "SLURM_PROCID") && find(env, "SLURM_STEP_NUM_TASKS")) {
    // SLURM_PROCID alone is also set in an sbatch script, which is one process, not a step.
    parse_slurm(env, out);
  } else if (const std::string* addr = find(env, "MASTER_ADDR")) {
    out.master_addr = *addr;  // harmless for a single process; kept for describe()
  }
  if (const std::string* v = find(env, "DDP_RDZV_TIMEOUT")) {
    out.rdzv_timeout = parse_seconds("DDP_RDZV_TIMEOUT", *v);
  }
  if (const std::string* v = find(env, "DDP_COLLECTIVE_TIMEOUT")) {
    out.collective_timeout = parse_seconds("DDP_COLLECTIVE_TIMEOUT", *v);
  }
  parse_store_knobs(env, out);
  out.debug = parse_debug_level(env);
  if (const std::string* v = find(env, "DDP_FLIGHT_RECORDER"); v != nullptr && !v->empty()) {
    out.flight_recorder_entries = parse_int("DDP_FLIGHT_RECORDER", *v, 0, 1 << 20,
                                            "a number of collectives to remember, 0 to turn the "
                                            "flight recorder off");
  }
  return out;
}

DebugLevel parse_debug_level(const EnvMap& env) {
  const std::string* v = find(env, "DDP_DEBUG");
  if (v == nullptr) v = find(env, "TORCH_DISTRIBUTED_DEBUG");
  if (v == nullptr) return DebugLevel::kOff;
  if (*v == "info" || *v == "INFO") return DebugLevel::kInfo;
  if (*v == "detail" || *v == "DETAIL") return DebugLevel::kDetail;
  DDP_CHECK(v->empty() || *v == "off" || *v == "OFF", ConfigError,
            "invalid value '{}' for DDP_DEBUG/TORCH_DISTRIBUTED_DEBUG: use off, info or detail",
            *v);
  return DebugLevel::kOff;
}

EnvMap current_environment() {
  EnvMap env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

std::string DistEnv::describe() const {
  std::string s = fmt::format("rank {}/{} (local {}/{}, node {}) via {}", rank, world_size,
                              local_rank, local_world_size, group_rank, to_string(contract));
  if (world_size > 1 || use_agent_store) {
    s += fmt::format("; store {}:{}{}", master_addr, master_port,
                     use_agent_store ? " (launcher's agent)" : "");
  }
  return s;
}

}  // namespace ddp
